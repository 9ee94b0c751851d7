"""Step counting, interrupt handling and TensorBoard scalars for the training loop.

Training runs one ``fit`` call per epoch (so each epoch's seeded order can be rebuilt), so
these callbacks keep their own counters in the shared ``TrainingState`` instead of trusting
Keras' per-call ones.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import keras
import tensorflow as tf
from tensorboard.compat.proto import event_pb2

from trainer.errors import CorruptCheckpointError
from trainer.state import TrainingState

log = logging.getLogger(__name__)


class RunProgress(keras.callbacks.Callback):
    """Counts steps into the state, restores a resumed epoch's metric sums, stops on signal."""

    def __init__(self, state: TrainingState, steps_per_epoch: int):
        super().__init__()
        self.state = state
        self.steps_per_epoch = steps_per_epoch
        self.requested_signal: int | None = None
        self.interrupted = False

    def on_epoch_begin(self, epoch, logs=None):
        self.state.epoch = epoch
        saved = self.state.extra.pop("metric_variables", None)
        if self.state.step_in_epoch and saved is not None:
            # Mid-epoch resume: Keras just reset the running means; put back the sums of
            # the batches already trained so the epoch's logged metrics cover all of them.
            variables = self.model.metrics_variables
            if len(variables) != len(saved):
                raise CorruptCheckpointError(
                    f"The checkpoint holds {len(saved)} metric accumulators but the model has "
                    f"{len(variables)}; resume with the same loss and metrics as the original "
                    f"run. Received {len(saved)} values"
                )
            for variable, value in zip(variables, saved, strict=True):
                variable.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        if self.requested_signal is not None and not self.interrupted:
            self.model.stop_training = True
            # On an epoch's last batch, let the epoch end normally (validation, history)
            # and count as interrupted from on_epoch_end on.
            self.interrupted = self.state.step_in_epoch < self.steps_per_epoch

    def on_epoch_end(self, epoch, logs=None):
        if self.interrupted:
            return  # the epoch did not finish; the state stays mid-epoch
        self.state.epoch = epoch + 1
        self.state.step_in_epoch = 0
        self.state.metrics = {k: float(v) for k, v in (logs or {}).items()}
        history = self.state.extra.setdefault("history", [])
        history.append({"epoch": epoch + 1, **self.state.metrics})
        self.interrupted = self.requested_signal is not None

    @contextlib.contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """While active, SIGTERM/SIGINT end training after the current batch (a second
        SIGINT interrupts at once)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request(signum, _frame):
            self.requested_signal = signum
            log.warning("Received %s: stopping after this batch", signal.Signals(signum).name)
            signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = {sig: signal.signal(sig, request) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class EpochProgress(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, numbering epochs out of the whole run.

    Training calls ``fit`` once per epoch, so Keras's own bar would say "Epoch 3/3" and
    leave out "Epoch 1/1". Placed in the callback list before the checkpointer, it also
    ends each epoch's line (with the validation metrics) before a save logs anything.
    """

    def __init__(self, epochs: int):
        super().__init__()
        self.total_epochs = epochs

    def set_params(self, params):
        super().set_params(params)
        self.epochs = self.total_epochs


class ScalarLogger(keras.callbacks.Callback):
    """Per-step and per-epoch scalars on one global-step axis, continued on resume:
    ``batch/<metric>`` for the loss and every compiled metric (Keras's running means over
    the epoch so far) and ``batch/learning_rate`` (the rate that step used), then
    ``epoch/<metric>`` with the validation metrics."""

    def __init__(self, log_dir: Path, state: TrainingState):
        super().__init__()
        self.state = state
        mark_session_start(Path(log_dir), state.global_step)
        self.writer = tf.summary.create_file_writer(str(log_dir))
        self._step_rate: float | None = None

    def on_train_batch_begin(self, batch, logs=None):
        # Read before the step: afterwards a schedule already gives the next step's rate.
        self._step_rate = current_learning_rate(self.model.optimizer)

    def on_train_batch_end(self, batch, logs=None):
        with self.writer.as_default(step=self.state.global_step):
            for key, value in (logs or {}).items():
                tf.summary.scalar(f"batch/{key}", float(value))
            if self._step_rate is not None:
                tf.summary.scalar("batch/learning_rate", self._step_rate)

    def on_epoch_end(self, epoch, logs=None):
        with self.writer.as_default(step=self.state.global_step):
            for key, value in (logs or {}).items():
                tf.summary.scalar(f"epoch/{key}", float(value))
            learning_rate = current_learning_rate(self.model.optimizer)
            if learning_rate is not None:
                tf.summary.scalar("epoch/learning_rate", learning_rate)
        self.writer.flush()

    def close(self):
        self.writer.close()


def current_learning_rate(optimizer) -> float | None:
    """The rate the optimizer's next step uses (a schedule evaluated at ``iterations``)."""
    rate = getattr(optimizer, "learning_rate", None)
    return None if rate is None else float(keras.ops.convert_to_numpy(rate))


def mark_session_start(log_dir: Path, step: int) -> None:
    """Record that training (re)starts after ``step``, so TensorBoard drops older events
    at later steps that a crashed or abandoned run wrote.

    TensorBoard treats every ``SessionLog.START`` after a run's first one as a restart and
    discards earlier events at or after its step; so every session writes one, at
    ``step + 1``. It goes into its own event file whose name sorts before the writer's
    next file (same timestamp prefix, then "0" before any host name), so it is read in
    between the old events and the new ones.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    name = f"events.out.tfevents.{int(now)}.0session.{step}.start"
    with tf.io.TFRecordWriter(str(log_dir / name)) as records:
        records.write(
            event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString()
        )
        start = event_pb2.Event(wall_time=now, step=step + 1)
        start.session_log.status = event_pb2.SessionLog.START
        records.write(start.SerializeToString())
