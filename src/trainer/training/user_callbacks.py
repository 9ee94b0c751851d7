"""Callbacks from the ``callbacks`` config (``conf/callbacks``) and their state in checkpoints.

Keras callbacks keep counters in plain attributes (EarlyStopping's ``wait`` and ``best``,
ReduceLROnPlateau's ``wait``, ``cooldown_counter`` and ``best``) and reset them in
``on_train_begin``. A resumed run would start them from zero and stop at another epoch than
a run that never stopped, so every checkpoint carries each configured callback's state, by
its config name, and the resumed run puts it back right after ``on_train_begin``.

A callback of your own takes part by defining ``state_dict() -> dict`` (JSON values) and
``load_state_dict(state)`` (see ``trainer.checkpointing.callback_state``). The rate that
ReduceLROnPlateau lowers is an optimizer variable, saved with the others.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras

from trainer.checkpointing.callback_state import load_state, refuse_unrestorable, state_of
from trainer.errors import ConfigError
from trainer.state import is_count, is_number
from trainer.training.instantiation import instantiate

log = logging.getLogger(__name__)


def build(callbacks_cfg: Any, run_dir: Path) -> dict[str, keras.callbacks.Callback]:
    """The ``callbacks`` config, ``{name: {_target_: ...}}``, instantiated in order; an entry
    set to null is left out. A callback with ``set_run_dir(path)`` is told the run directory
    (``trainer.callbacks.CSVLogger`` puts its file there)."""
    if not callbacks_cfg:
        return {}
    if not isinstance(callbacks_cfg, Mapping):  # DictConfig is one
        raise ConfigError(
            f"callbacks must map names to {{_target_: ...}} configs, e.g. "
            f"callbacks=[early_stopping] or '+callbacks.NAME={{_target_: pkg.Class}}'. "
            f"Received: {type(callbacks_cfg).__name__}"
        )
    out = {}
    for name, spec in callbacks_cfg.items():
        if spec is None:
            continue
        check_settings(str(name), spec)
        callback = instantiate(spec, f"callbacks.{name}")
        if not isinstance(callback, keras.callbacks.Callback):
            raise ConfigError(
                f"callbacks.{name} must build a keras.callbacks.Callback; point its _target_ "
                f"at a Callback class. Received: {type(callback).__name__}"
            )
        if hasattr(callback, "set_run_dir"):
            callback.set_run_dir(Path(run_dir))
        out[str(name)] = callback
    return out


# Settings of Keras' plateau callbacks that Keras stores unchecked and first compares at an
# epoch's end without improvement (``patience="abc"`` failed there with a raw TypeError),
# or takes silently (``mode="foo"`` falls back to auto, a negative ``min_delta`` counts a
# worse value as an improvement). Each: (test, what it must be).
_SETTINGS: dict[str, tuple[Any, str]] = {
    "patience": (is_count, "a whole number of epochs, at least 0"),
    "start_from_epoch": (is_count, "a whole number of epochs, at least 0"),
    "cooldown": (is_count, "a whole number of epochs, at least 0"),
    "verbose": (is_count, "a whole number, at least 0 (0 = silent)"),
    "min_delta": (lambda v: is_number(v) and v >= 0, "a number, at least 0"),
    "min_lr": (lambda v: is_number(v) and v >= 0, "a number, at least 0"),
    "factor": (lambda v: is_number(v) and 0 < v < 1, "a number between 0 and 1 (exclusive)"),
    "baseline": (lambda v: v is None or is_number(v), "a number or null"),
    "mode": (lambda v: v in ("min", "max", "auto"), "one of min, max, auto"),
    "monitor": (lambda v: isinstance(v, str) and v != "", "a logged metric's name"),
    "restore_best_weights": (lambda v: isinstance(v, bool), "true or false"),
}
_CHECKED = (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau)


def check_settings(name: str, spec: Any) -> None:
    """Refuse, before the run starts, a setting of an EarlyStopping or ReduceLROnPlateau
    entry (or a subclass) that Keras would only trip over epochs into the run, or use
    silently as something else. Other callbacks' settings are their own to check."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("_target_"), str):
        return  # instantiate reports it
    module, _, attribute = spec["_target_"].rpartition(".")
    try:  # not hydra.utils.get_class: it logs an ERROR line of its own for a bad target
        cls = getattr(importlib.import_module(module), attribute)
    except Exception:  # not importable (or nested deeper): instantiate reports it
        return
    if not isinstance(cls, type) or not issubclass(cls, _CHECKED):
        return
    for key, value in spec.items():
        test, must_be = _SETTINGS.get(str(key), (None, ""))
        if test is not None and not test(value):
            raise ConfigError(
                f"callbacks.{name}.{key} ({cls.__name__}) must be {must_be}; fix it in the "
                f"config or on the command line (callbacks.{name}.{key}=...). "
                f"Received: {value!r}"
            )


class ConfigCallbacks(keras.callbacks.CallbackList):
    """The configured callbacks as one callback: restores their saved state after their own
    ``on_train_begin``, and hides from them the end of an epoch that a signal cut short (it
    did not end: the resumed run finishes it, and they see its end then, once)."""

    def __init__(
        self,
        named: dict[str, keras.callbacks.Callback],
        state: Any,
        saved: dict[str, dict[str, Any]] | None = None,
    ):
        super().__init__(list(named.values()))
        self.named = named
        self.state = state  # the run's TrainingState: step_in_epoch 0 = the epoch ended
        self.saved = dict(saved or {})
        for name, callback in named.items():
            if name in self.saved:
                refuse_unrestorable(name, callback, self.saved[name])

    def on_train_begin(self, logs=None):
        check_rate_setters(self.named, self.model)
        super().on_train_begin(logs)
        for name, callback in self.named.items():
            if name in self.saved:
                load_state(name, callback, self.saved.pop(name))
                log.info("Restored the state of callbacks.%s", name)
            elif state_of(callback) is not None:
                log.info("callbacks.%s has no saved state: it starts afresh", name)
                if self.state.global_step == 0 and hasattr(callback, "start_afresh"):
                    callback.start_afresh()  # a new run: nothing earlier belongs to it
        for name in self.saved:
            # %r: the name is the checkpoint's, and could hold a line break of its own.
            log.warning("The checkpoint holds state of callback %r; it is not configured", name)

    def on_epoch_end(self, epoch, logs=None):
        if self.state.step_in_epoch == 0:  # RunProgress ran first: 0 = the epoch completed
            super().on_epoch_end(epoch, logs)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, callback in self.named.items():
            state = state_of(callback)
            if state is not None:
                out[name] = state
        return out


RATE_SETTERS = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)


def check_rate_setters(named: dict[str, keras.callbacks.Callback], model: keras.Model) -> None:
    """A callback that sets the learning rate cannot work with a learning-rate schedule,
    which owns the rate: Keras would raise a TypeError at the first plateau, epochs into the
    run. Refuse it before the first step instead (``train`` calls it before the session
    writes anything; ``ConfigCallbacks.on_train_begin`` again, for other ``fit`` calls)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    rate = optimizer.get_config().get("learning_rate")
    if not isinstance(rate, dict):  # a number: settable
        return
    for name, callback in named.items():
        if isinstance(callback, RATE_SETTERS):
            raise ConfigError(
                f"callbacks.{name} ({type(callback).__name__}) sets the learning rate, but the "
                f"optimizer's rate comes from a schedule ({rate.get('class_name')}), which "
                f"cannot be set. Use schedule=none with it, or leave the callback out. "
                f"Received: callbacks.{name} with a {rate.get('class_name')} schedule"
            )
