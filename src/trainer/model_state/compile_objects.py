"""Complete the configs of losses and metrics that Keras's ``get_config`` leaves short.

Every backend compiles a loaded model from its serialized compile config. Keras 3.15's
``Huber.get_config`` leaves out ``delta``; ``CosineSimilarity`` (loss and metric) and
``SparseCategoricalCrossentropy`` leave out ``axis``; ``SparseTopKCategoricalAccuracy``
leaves out ``from_sorted_ids``: arguments their wrapped function receives on every call.
A ``Huber(delta=0.3)`` came back as ``delta=1.0`` and trained on another loss, without a
word (a probe's evaluation: 0.586 before the save, 0.970 after), in every backend and in
Keras's own ``.keras``. Each such argument is written into the serialized config where the
class's constructor takes it (``from_config`` passes the config to the constructor); an
argument it does not take, that a rebuild from the config would change, is refused at
save time.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import keras

from trainer._compat import keras_training as training_compat
from trainer.errors import ModelNotReadyError

# The compile arguments that hold losses and metrics, in their output structure.
_HOLDING = ("loss", "metrics", "weighted_metrics")
_MISSING = object()


def complete(serialized: dict[str, Any], arguments: dict[str, Any], model_name: str) -> None:
    """Add to ``serialized`` (a compile config, changed in place) every argument its losses
    and metrics compute with but their configs leave out; ``arguments``: what ``compile``
    was given (``training_compat.compile_arguments``)."""
    for key in _HOLDING:
        if key in serialized and key in arguments:
            _walk(arguments[key], serialized[key], f"{key}", model_name)


def _walk(live: Any, stored: Any, where: str, model_name: str) -> None:
    if isinstance(live, keras.losses.Loss | keras.metrics.Metric):
        if isinstance(stored, dict) and isinstance(stored.get("config"), dict):
            _complete_one(live, stored["config"], where, model_name)
    elif isinstance(live, dict) and isinstance(stored, dict):
        for name, value in live.items():
            if name in stored:
                _walk(value, stored[name], f"{where}[{name!r}]", model_name)
    elif isinstance(live, list | tuple) and isinstance(stored, list | tuple):
        for index, (value, entry) in enumerate(zip(live, stored, strict=False)):
            _walk(value, entry, f"{where}[{index}]", model_name)


def _complete_one(live: Any, config: dict[str, Any], where: str, model_name: str) -> None:
    taken = inspect.signature(type(live).__init__).parameters
    lost = {}
    for name, value in training_compat.wrapped_function_arguments(live).items():
        if name in config:
            continue
        if name in taken and _plain(value):
            config[name] = value
        else:
            lost[name] = value
    if lost and _rebuilt_differently(live, config, lost):
        raise ModelNotReadyError(
            f"The {type(live).__name__} compiled as {where} of model {model_name!r} computes "
            f"with {sorted(lost)}, which its get_config leaves out and its constructor does "
            f"not take: a loaded model would compile it with other values and train on "
            f"something else. Compile with an object whose config holds every argument "
            f"(a subclass with its own get_config). Received: {lost}"
        )


def _plain(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _rebuilt_differently(live: Any, config: dict[str, Any], lost: dict[str, Any]) -> bool:
    try:
        rebuilt = type(live).from_config(dict(config))
    except Exception:  # any failure: it cannot be rebuilt as it is
        return True
    again = training_compat.wrapped_function_arguments(rebuilt)
    return any(again.get(name, _MISSING) != value for name, value in lost.items())
