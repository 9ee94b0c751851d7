"""The state of Keras callbacks, as JSON, so that it can travel with a checkpoint.

Keras callbacks keep counters in plain attributes (EarlyStopping's ``wait`` and ``best``,
ReduceLROnPlateau's ``wait``, ``cooldown_counter`` and ``best``) and reset them in
``on_train_begin``: a resumed run would start them from zero and stop at another epoch than
a run that never stopped. ``state_of`` reads them (``KERAS_STATE`` lists the public
attributes), ``load_state`` puts them back; a callback of your own takes part by defining
``state_dict() -> dict`` (JSON values) and ``load_state_dict(state)``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import keras
import numpy as np

from trainer.errors import ConfigError, CorruptCheckpointError
from trainer.state import is_count, is_number

# Keras callbacks whose counters decide what they do next, and the attributes holding them.
KERAS_STATE: dict[type, tuple[str, ...]] = {
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_epoch"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
}


def state_of(callback: keras.callbacks.Callback) -> dict[str, Any] | None:
    """The callback's resumable state, or None if it keeps none."""
    if hasattr(callback, "state_dict"):
        return _json_state(callback, callback.state_dict())
    for cls, names in KERAS_STATE.items():
        if isinstance(callback, cls):
            return {name: _plain(getattr(callback, name, None)) for name in names}
    return None


def _json_state(callback: keras.callbacks.Callback, state: Any) -> Any:
    """A callback's own ``state_dict()``, which every backend stores as JSON: anything else
    is the callback's to fix, said so here (it failed inside the save, reported as a disk
    or permission problem, and ``on_save_error=continue`` trained on without it)."""
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"The state_dict() of callback {type(callback).__name__} must return JSON values "
            f"(a dict of numbers, strings, booleans, None, lists and dicts; float(x) for a "
            f"NumPy value, finite numbers only): checkpoints store it as JSON. Received "
            f"{type(error).__name__}: {error}"
        ) from None
    return state


def keeps_state(callback: keras.callbacks.Callback) -> bool:
    """Whether ``state_of`` can read ``callback``'s state (its own ``state_dict``, or a
    Keras callback listed in ``KERAS_STATE``)."""
    return hasattr(callback, "state_dict") or isinstance(callback, tuple(KERAS_STATE))


def load_state(name: str, callback: keras.callbacks.Callback, state: dict[str, Any]) -> None:
    """Put ``state`` (from ``state_of``) back into ``callback``."""
    if hasattr(callback, "load_state_dict"):
        callback.load_state_dict(state)
        return
    if isinstance(callback, keras.callbacks.EarlyStopping):
        _check_best_weights(name, callback, state)
    for cls, names in KERAS_STATE.items():
        if isinstance(callback, cls):
            for key in names:
                if key in state:
                    setattr(callback, key, state[key])


def refuse_unrestorable(name: str, callback: keras.callbacks.Callback, state: Any) -> None:
    """What ``load_state`` would refuse for ``callback``, refused now: when a run is being
    built, before it writes anything of its session (its TensorBoard hparams included).
    The state is the checkpoint's: values of the wrong type (``best: "abc"``) failed with
    a raw error at the first epoch's end, after the session had started writing."""
    if not isinstance(state, dict):
        raise _damaged(name, "its saved state must be a JSON object", state)
    if hasattr(callback, "check_state_dict"):  # a callback of trainer's own
        callback.check_state_dict(state)
    for cls, names in KERAS_STATE.items():
        if isinstance(callback, cls):
            for key in names:
                if not _restorable(key, state.get(key)):
                    raise _damaged(
                        name,
                        f"{key!r} must be {'a number' if key == 'best' else 'a count'} or null",
                        state,
                    )
    if isinstance(callback, keras.callbacks.EarlyStopping):
        _check_best_weights(name, callback, state)


def _restorable(key: str, value: Any) -> bool:
    """A Keras callback counter as ``state_of`` writes it: None, a number for ``best``,
    else a count."""
    return value is None or (is_number(value) if key == "best" else is_count(value))


def _damaged(name: str, problem: str, state: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"The checkpoint's state of callback {name!r} is damaged: {problem}. Resume from "
        f"another checkpoint, or remove callbacks.{name} from the config to start it "
        f"afresh. Received: {str(state)[:300]}"
    )


def _check_best_weights(name: str, callback, state: dict[str, Any]) -> None:
    if callback.restore_best_weights and state.get("best") is not None:
        raise ConfigError(
            f"Callback {name!r} is an EarlyStopping with restore_best_weights=True, but the "
            f"weights of its best epoch ({int(state.get('best_epoch') or 0) + 1}) are not part "
            f"of checkpoints, so a resumed run could not put them back. Set "
            f"restore_best_weights=False (in a config: callbacks.{name}.restore_best_weights="
            f"false) and keep the best checkpoint with keep_best=1 (checkpoint.policy."
            f"keep_best=1) instead, or start a fresh run. Received: restore_best_weights=True"
        )


def _plain(value: Any) -> Any:
    """A JSON value for a counter: Python int or float (numpy scalars converted), or None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    value = float(keras.ops.convert_to_numpy(value))
    return value if math.isfinite(value) else None
