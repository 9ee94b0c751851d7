"""Keras callbacks that the training loop attaches: checkpoint saving and TensorBoard scalars.

Training runs one ``fit`` call per epoch (so each epoch's seeded order can be rebuilt), so
these callbacks keep their own step counters instead of trusting Keras' per-call ones.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer.save_backends.base import SaveBackend
from trainer.state import TrainingState

log = logging.getLogger(__name__)


class RunProgress(keras.callbacks.Callback):
    """Counts optimizer steps and remembers the latest logs for the other callbacks."""

    def __init__(self, state: TrainingState):
        super().__init__()
        self.state = state

    def on_epoch_begin(self, epoch, logs=None):
        self.state.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.state.global_step += 1
        self.state.step_in_epoch += 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
        self.state.step_in_epoch = 0
        self.state.metrics = {k: float(v) for k, v in (logs or {}).items()}


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves through the configured backend at the end of every epoch."""

    def __init__(
        self,
        backend: SaveBackend,
        directory: Path,
        name_pattern: str,
        state: TrainingState,
        metadata: dict[str, Any],
    ):
        super().__init__()
        self.backend = backend
        self.directory = Path(directory)
        self.name_pattern = name_pattern
        self.state = state
        self.metadata = metadata
        self.saved: list[Path] = []

    def on_epoch_end(self, epoch, logs=None):
        name = self.name_pattern.format(epoch=epoch + 1, step=self.state.global_step)
        start = time.perf_counter()
        path = self.backend.save(
            self.model, self.directory / name, state=self.state, metadata=self.metadata
        )
        log.info("Saved checkpoint %s in %.2fs", path, time.perf_counter() - start)
        self.saved.append(path)


class ScalarLogger(keras.callbacks.Callback):
    """Writes per-step loss and per-epoch metrics to TensorBoard on a global step axis."""

    def __init__(self, log_dir: Path, state: TrainingState):
        super().__init__()
        self.state = state
        self.writer = tf.summary.create_file_writer(str(log_dir))

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs:
            with self.writer.as_default(step=self.state.global_step):
                tf.summary.scalar("batch/loss", float(logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        with self.writer.as_default(step=epoch + 1):
            for key, value in (logs or {}).items():
                tf.summary.scalar(f"epoch/{key}", float(value))
            learning_rate = getattr(self.model.optimizer, "learning_rate", None)
            if learning_rate is not None:
                tf.summary.scalar("epoch/learning_rate", float(learning_rate))
        self.writer.flush()

    def close(self):
        self.writer.close()
