"""A model class's own training logic, which no traced function carries.

A subclassed model may override how it trains, evaluates or predicts (``train_step``,
``compute_loss``, ...): a GAN, a contrastive model, a custom loss. Revived from its traced
functions because its class is missing at load, it computes its outputs as saved, but
``fit`` / ``evaluate`` / ``predict`` would run Keras's default steps instead of its own,
and train differently without a word. The save records which of those methods the class
overrides; a load without the class then refuses to compile such a model, and a model
loaded uncompiled (for inference) refuses those calls, naming the class to pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras

from trainer._compat import live_objects
from trainer.errors import MissingClassError

METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def overridden(layer: keras.layers.Layer) -> list[str]:
    """The training-logic methods ``layer``'s class overrides (models only)."""
    if not isinstance(layer, keras.Model):
        return []
    return [m for m in METHODS if getattr(type(layer), m, None) is not getattr(keras.Model, m)]


# What a Functional or Sequential subclass may override to compute something else than
# its graph: rebuilt from its config as a plain graph, it would lose that.
COMPUTATION = ("__call__", "call", "compute_mask", "compute_output_spec")


def computation_overridden(layer: keras.layers.Layer) -> list[str]:
    """The methods of ``COMPUTATION`` that ``layer``'s class defines outside Keras (models
    only): a graph model's class missing at load, it must then revive from its traces."""
    if not isinstance(layer, keras.Model):
        return []
    found = []
    for method in COMPUTATION:
        owner = next((c for c in type(layer).__mro__ if method in vars(c)), None)
        if owner is not None and not owner.__module__.startswith("keras."):
            found.append(method)
    return found


def guard(
    model: keras.Model, record: dict[str, Any], class_missing: bool, compile: bool, where: Path
) -> None:
    """Refuse, or fence off, the training logic a root revived without its class (from
    its traces, or as the plain graph of a Functional subclass) has lost."""
    stored = record.get("training_logic")
    methods = [m for m in stored if m in METHODS] if isinstance(stored, list) else []
    if not class_missing or not methods:
        return
    name = str(record.get("registered_name") or record.get("class_name"))
    message = (
        f"{where}: the model's class {name!r} is not available here and overrides "
        f"{', '.join(methods)}. Revived without it, it computes its outputs "
        f"as saved, but would train and evaluate with Keras's default steps instead of its "
        f"own. Import the module that defines it (or pass custom_objects={{{name!r}: cls}}) "
        f"to train or evaluate it; for inference alone, load with compile=False and call "
        f"the model. Received: missing {name!r}"
    )
    if compile:
        raise MissingClassError(message)
    for method in methods:
        live_objects.patch_method(model, method, _refusing(message))  # for good: no restore


def _refusing(message: str):
    def refuse(*args, **kwargs):
        raise MissingClassError(message)

    return refuse
