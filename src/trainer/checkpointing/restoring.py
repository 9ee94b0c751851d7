"""Restoring a loaded checkpoint into an existing model: every variable by position, and
NumPy's global RNG, which the training state carries as JSON values."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from trainer.checkpointing.shadow import all_variables
from trainer.errors import ConfigMismatchError
from trainer.model_state import kit, trainable
from trainer.save_backends import LoadedCheckpoint
from trainer.state import TrainingState


def restore_into(model: keras.Model, checkpoint: LoadedCheckpoint) -> TrainingState:
    """Copy a loaded checkpoint into an existing model of the same architecture.

    Every variable by position (weights, RNG seed states, optimizer slots and counters),
    which layers are trainable, and NumPy's global RNG.

    Args:
        model: The model to restore into; its optimizer is built if it is not yet.
        checkpoint: What ``load_checkpoint`` returned.

    Returns:
        The checkpoint's ``TrainingState``.

    Raises:
        ConfigMismatchError: ``model`` does not have the checkpoint's variables (another
            architecture or optimizer), or its layers cannot take the saved trainable flags.
    """
    _build_optimizer_like(model, checkpoint)
    source, target = all_variables(checkpoint.model), all_variables(model)
    shapes = [tuple(v.shape) for v in source], [tuple(v.shape) for v in target]
    if shapes[0] != shapes[1]:
        first = next(
            (i for i, (a, b) in enumerate(zip(*shapes, strict=False)) if a != b),
            min(len(shapes[0]), len(shapes[1])),
        )
        detail = (
            f"variable #{first} ({target[first].path if first < len(target) else 'none'}) "
            f"has shape {shapes[1][first] if first < len(target) else None} in the model but "
            f"{shapes[0][first] if first < len(source) else None} in the checkpoint"
        )
        raise ConfigMismatchError(
            f"Checkpoint {checkpoint.path} does not fit the configured model: {detail} "
            f"({len(source)} vs {len(target)} variables). Use the model config the checkpoint "
            f"was trained with, or start a fresh run. Received: {type(model).__name__} "
            f"{model.name!r} with {len(target)} variables"
        )
    try:
        trainable.match_trainable(checkpoint.model, model)
    except ValueError as error:
        raise ConfigMismatchError(
            f"Checkpoint {checkpoint.path} does not fit the configured model: {error}, so "
            f"which layers are trainable cannot be carried over. Use the model config the "
            f"checkpoint was trained with, or start a fresh run. Received: "
            f"{type(model).__name__} {model.name!r}"
        ) from None
    for src, dst in zip(source, target, strict=True):
        dst.assign(src)
    set_numpy_rng(checkpoint.state.numpy_rng)
    return checkpoint.state


def _build_optimizer_like(model: keras.Model, checkpoint: LoadedCheckpoint) -> None:
    """Build ``model``'s optimizer for the variables the checkpoint's was built for, with
    the same ones left out of weight decay (Keras keeps both outside the config)."""
    built_for = trainable.optimizer_built_for(checkpoint.model)
    no_decay = trainable.no_weight_decay(checkpoint.model)
    mismatch = None
    highest = max([*(built_for or []), *(no_decay or [])], default=-1)
    if highest >= len(model.weights):
        mismatch = f"its optimizer refers to weight #{highest}, and the model has "
    elif _built(model) and trainable.no_weight_decay(model) != no_decay:
        mismatch = "its optimizer leaves other variables out of weight decay than "
    if mismatch is not None:
        raise ConfigMismatchError(
            f"Checkpoint {checkpoint.path} does not fit the configured model: {mismatch}"
            f"the model's ({len(model.weights)} weights). Use the model and optimizer config "
            f"the checkpoint was trained with, or start a fresh run. Received: "
            f"{type(model).__name__} {model.name!r}"
        )
    kit.build_optimizer(model, built_for, no_decay=no_decay)


def _built(model: keras.Model) -> bool:
    """The optimizer exists and has its variables (weight decay can no longer change)."""
    return getattr(model, "optimizer", None) is not None and model.optimizer.built


def numpy_rng_record() -> list[Any]:
    """NumPy's global RNG state as JSON values, for a checkpoint's state.

    Returns:
        The state, a list of JSON values (``set_numpy_rng`` puts it back).
    """
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def set_numpy_rng(record: list[Any] | None) -> None:
    if record:
        np.random.set_state((record[0], np.asarray(record[1], dtype=np.uint32), *record[2:]))
