"""Model-level state that every backend stores the same way: compile config and the
optimizer's variables (iteration count, learning rate, every slot).

Optimizer variables are matched by position, not by path: Keras names slots after the
layer paths at creation time, which differ between the saving and the loading process.
Position is stable because both sides build the optimizer over the same
``model.trainable_variables`` in the same order.
"""

from __future__ import annotations

import json
from typing import Any

import keras
import numpy as np

from trainer.errors import CorruptCheckpointError


def compile_config(model: keras.Model) -> dict[str, Any] | None:
    """The serialized arguments of ``model.compile``, or None if it was never compiled."""
    if not getattr(model, "compiled", False):
        return None
    config = dict(model.get_compile_config())
    if config.get("optimizer") is None and getattr(model, "optimizer", None) is not None:
        # Keras' legacy .h5 save pops "optimizer" from the live compile config (3.15,
        # legacy/saving/saving_utils.py); without this a reload would compile RMSprop.
        config["optimizer"] = keras.saving.serialize_keras_object(model.optimizer)
    json.dumps(config)  # fail now, not in the middle of a write, if it is not JSON-able
    return config


def restore_compile(
    model: keras.Model, config: dict[str, Any] | None, custom_objects: dict[str, Any]
) -> None:
    """Compile ``model`` as it was at save time and create its optimizer variables."""
    if not config:
        return
    with keras.saving.custom_object_scope(custom_objects):
        model.compile_from_config(config)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def optimizer_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """(path, value) of every optimizer variable, in the optimizer's own order."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return [(v.path, np.asarray(keras.ops.convert_to_numpy(v))) for v in optimizer.variables]


def restore_optimizer_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    """Assign saved optimizer values by position, checking count and shapes."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        if arrays:
            raise CorruptCheckpointError(
                f"{where} holds {len(arrays)} optimizer variables but no compile config to "
                f"rebuild the optimizer from. The checkpoint is inconsistent; re-save it."
            )
        return
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    assign_by_position(
        optimizer.variables, arrays, where, f"optimizer variables ({type(optimizer).__name__})"
    )


def model_weight_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """(path, value) of every model weight (trainable and non-trainable, no RNG seeds)."""
    return [(v.path, np.asarray(keras.ops.convert_to_numpy(v))) for v in model.weights]


def restore_model_weight_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    assign_by_position(model.weights, arrays, where, "model variables")


def rng_state_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """(path, value) of the model's RNG seed states (Dropout etc.), absent from ``weights``.

    Keras draws a fresh random seed for every rebuilt layer and ``save_weights`` skips these
    variables, so without them a resumed run would drop out different units.
    """
    return [(v.path, np.asarray(keras.ops.convert_to_numpy(v))) for v in _rng_variables(model)]


def restore_rng_state_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    assign_by_position(_rng_variables(model), arrays, where, "RNG seed states")


def assign_by_position(variables: list, arrays: list[np.ndarray], where: str, what: str) -> None:
    """Assign ``arrays`` to ``variables`` in order, refusing any count or shape mismatch."""
    if len(variables) != len(arrays):
        raise CorruptCheckpointError(
            f"{where} holds {len(arrays)} {what} but the model rebuilt from its config has "
            f"{len(variables)}. The checkpoint is damaged or was edited; load an older one."
        )
    for variable, value in zip(variables, arrays, strict=True):
        if tuple(variable.shape) != tuple(value.shape):
            raise CorruptCheckpointError(
                f"{where}: variable {variable.path!r} (among the {what}) has shape "
                f"{tuple(variable.shape)} but the checkpoint holds shape {tuple(value.shape)}. "
                f"The checkpoint is damaged or was edited."
            )
        variable.assign(value)


def _rng_variables(model: keras.Model) -> list:
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]
