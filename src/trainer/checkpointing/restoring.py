"""Restoring a loaded checkpoint into an existing model: every variable by position, and
NumPy's global RNG, which the training state carries as JSON values."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from trainer.checkpointing.snapshot import all_variables
from trainer.errors import ConfigMismatchError
from trainer.save_backends import Checkpoint, modelstate, trainable
from trainer.state import TrainingState


def restore_into(model: keras.Model, checkpoint: Checkpoint) -> TrainingState:
    """Copy every variable of the loaded checkpoint into ``model`` by position (weights, RNG
    seed states, optimizer slots and counters), which layers are trainable, and NumPy's
    global RNG; return its state."""
    modelstate.build_optimizer(model, trainable.optimizer_built_for(checkpoint.model))
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
            f"was trained with, or start a fresh run."
        )
    for src, dst in zip(source, target, strict=True):
        dst.assign(src)
    trainable.match_trainable(checkpoint.model, model)
    set_numpy_rng(checkpoint.state.numpy_rng)
    return checkpoint.state


def numpy_rng_record() -> list[Any]:
    """NumPy's global RNG state as JSON values (``set_numpy_rng`` puts it back)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def set_numpy_rng(record: list[Any] | None) -> None:
    if record:
        np.random.set_state((record[0], np.asarray(record[1], dtype=np.uint32), *record[2:]))
