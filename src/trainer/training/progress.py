"""Step counting, interrupt handling, the progress bar and TensorBoard scalars of a run.

A run is one ``fit`` over every remaining epoch (``trainer.data.run_dataset``); a resumed
run starts in the middle of an epoch, where Keras' own counters start at 0. So these
callbacks keep their counters in the shared ``TrainingState`` instead of trusting Keras'.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path

import keras
import tensorflow as tf
from tensorboard.compat.proto import event_pb2

from trainer.checkpointing import Checkpoint
from trainer.checkpointing.keras_callback import BatchCounter
from trainer.checkpointing.policy import scalar_metrics
from trainer.errors import CorruptCheckpointError
from trainer.state import TrainingState
from trainer.tensorboard.summary_writes import SummaryWrites, open_writer
from trainer.training import interrupts

__all__ = ["Checkpoint", "RunProgbar", "RunProgress", "ScalarLogger"]

log = logging.getLogger(__name__)


class RunProgress(keras.callbacks.Callback):
    """Counts steps into the state, restores a resumed epoch's metric sums, stops on signal,
    and ends a resumed epoch after its last batch (see ``epoch_cutter``).

    Goes before every callback of the user: its ``on_epoch_end`` must run first.
    """

    def __init__(self, state: TrainingState, steps_per_epoch: int):
        super().__init__()
        self.state = state
        self.steps_per_epoch = steps_per_epoch
        self.requested_signal: int | None = None
        self.interrupted = False
        self.cut_epoch = False  # set by the cutter: this epoch was ended early on purpose
        self.batches = BatchCounter()

    def epoch_cutter(self) -> keras.callbacks.Callback:
        """The callback that ends a resumed epoch: goes after every other callback.

        Keras runs ``steps_per_epoch`` batches in every epoch, but a resumed epoch has only
        the batches that were not trained before the stop. After its last one, the cutter
        sets ``model.stop_training`` (Keras then validates and ends the epoch as usual) and
        ``RunProgress.on_epoch_end``, before any other callback sees it, clears it again so
        the next epoch follows. A stop that another callback requested at that batch (it
        is already set when the cutter runs, last) is left alone.
        """
        return _EpochCutter(self)

    def on_epoch_begin(self, epoch, logs=None):
        self.state.epoch = epoch
        self.batches.reset()
        saved, self.state.metric_variables = self.state.metric_variables, []
        if self.state.step_in_epoch and saved:
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
        trained = self.batches.advance(batch, self.params.get("steps"))
        self.state.global_step += trained
        self.state.step_in_epoch += trained
        if self.requested_signal is not None and not self.interrupted:
            self.model.stop_training = True
            # On an epoch's last batch, let the epoch end normally (validation, history)
            # and count as interrupted from on_epoch_end on.
            self.interrupted = self.state.step_in_epoch < self.steps_per_epoch

    def on_epoch_end(self, epoch, logs=None):
        if self.cut_epoch:
            self.cut_epoch = False
            self.model.stop_training = False
        if self.interrupted:
            return  # the epoch did not finish; the state stays mid-epoch
        self.state.epoch = epoch + 1
        self.state.step_in_epoch = 0
        self.state.metrics = scalar_metrics(logs)
        self.state.history.append({"epoch": epoch + 1, **self.state.metrics})
        self.interrupted = self.requested_signal is not None
        if self.interrupted:
            # A signal that came after the epoch's last batch (during validation): the epoch
            # is complete, and no batch of the next may run. Without this the next epoch
            # trained on, past any stop, and its state counted more steps than it has.
            self.model.stop_training = True

    def stop_on_signals(self) -> interrupts.Phase:
        """The training loop's phase (``with progress.stop_on_signals():``): SIGTERM/SIGINT
        end training after the current batch (a second SIGINT interrupts at once)."""

        def request(signum, _frame):
            self.requested_signal = signum
            interrupts.record(signum)  # a multirun stops its sweep after this job
            log.warning("Received %s: stopping after this batch", signal.Signals(signum).name)
            phase.interrupt_at_once()

        phase = interrupts.Phase("training loop", request)
        return phase


class _EpochCutter(keras.callbacks.Callback):
    """See ``RunProgress.epoch_cutter``."""

    def __init__(self, progress: RunProgress):
        super().__init__()
        self.progress = progress

    def on_train_batch_end(self, batch, logs=None):
        progress = self.progress
        if (
            progress.state.step_in_epoch >= progress.steps_per_epoch
            and batch + 1 < progress.steps_per_epoch  # Keras would go on: a resumed epoch
            and not self.model.stop_training
        ):
            self.model.stop_training = True
            progress.cut_epoch = True


class RunProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, counting a resumed epoch from the batches trained before the
    stop: ``12/45`` ... ``45/45`` rather than ``1/45`` ... ``34/45``."""

    def __init__(self, state: TrainingState):
        super().__init__()
        self.state = state
        self.offset = 0

    def set_params(self, params):
        """Keras draws its live bar (``\\r``, backspaces, ANSI colours) whenever Python runs
        on a POSIX system, terminal or not, so a log file or a pipe (``| tee log``, a batch
        job's output) fills with control characters and a line per update. Without a
        terminal, ``verbose=1`` prints what ``verbose=2`` does: one plain line per epoch."""
        super().set_params(params)
        if self.verbose == 1 and not _is_terminal(sys.stdout):
            self.verbose = 2

    def on_epoch_begin(self, epoch, logs=None):
        self.offset = self.state.step_in_epoch
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch + self.offset, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.state.step_in_epoch and self.progbar is not None:  # stopped mid-epoch
            items = list((logs or {}).items())
            self.progbar.update(self.state.step_in_epoch, items, finalize=True)
            return
        super().on_epoch_end(epoch, logs)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ScalarLogger(keras.callbacks.Callback):
    """Per-step and per-epoch scalars on one global-step axis, continued on resume:
    ``batch/<metric>`` for the loss and every compiled metric (Keras's running means over
    the epoch so far) and ``batch/learning_rate`` (the rate that step used), then
    ``epoch/<metric>`` with the validation metrics.

    ``on_write_error`` is the run's ``checkpoint.policy.on_save_error``: a failed write
    (a full disk) stops training with ``TensorBoardWriteError`` (``raise``) or is logged
    once and skipped (``continue``), see ``trainer.tensorboard.summary_writes``."""

    def __init__(self, log_dir: Path, state: TrainingState, *, on_write_error: str = "raise"):
        super().__init__()
        self.state = state
        self.writes = SummaryWrites(log_dir, on_write_error)
        with self.writes.writing("writing the session-start mark"):
            mark_session_start(Path(log_dir), state.global_step)
        writer = open_writer(self.writes, Path(log_dir))
        self.writer = writer or tf.summary.create_noop_writer()
        self._step_rate: float | None = None

    def on_train_batch_begin(self, batch, logs=None):
        # Read before the step: afterwards a schedule already gives the next step's rate.
        self._step_rate = current_learning_rate(self.model.optimizer)

    def on_train_batch_end(self, batch, logs=None):
        step = self.state.global_step
        with self.writes.writing("writing batch scalars"), self.writer.as_default(step=step):
            for key, value in scalar_metrics(logs).items():  # arrays: not scalars
                tf.summary.scalar(f"batch/{key}", value)
            if self._step_rate is not None:
                tf.summary.scalar("batch/learning_rate", self._step_rate)

    def on_epoch_end(self, epoch, logs=None):
        if self.state.step_in_epoch != 0:
            # Stopped mid-epoch (RunProgress ran first: 0 = the epoch completed). Keras
            # still ends the epoch, with the partial epoch's running means and a validation
            # of mid-epoch weights; as a point it would stay beside the resumed epoch's own
            # (TensorBoard keeps steps before a restart mark), on no epoch's boundary.
            return
        learning_rate = current_learning_rate(self.model.optimizer)
        step = self.state.global_step
        with self.writes.writing("writing epoch scalars"), self.writer.as_default(step=step):
            for key, value in scalar_metrics(logs).items():  # arrays: not scalars
                tf.summary.scalar(f"epoch/{key}", value)
            if learning_rate is not None:
                tf.summary.scalar("epoch/learning_rate", learning_rate)
            self.writer.flush()

    def close(self):
        with self.writes.writing("closing the event file"):
            self.writer.close()
        self.writes.report()


def current_learning_rate(optimizer) -> float | None:
    """The rate the optimizer's next step uses (a schedule evaluated at ``iterations``)."""
    rate = getattr(optimizer, "learning_rate", None)
    return None if rate is None else float(keras.ops.convert_to_numpy(rate))


# Sorts before any host name (letters and digits; "0session" sorted after a host named
# "0a1b..." , a container id, whose resumed sessions TensorBoard then purged).
SESSION_MARK = "+session"


def mark_session_start(log_dir: Path, step: int) -> None:
    """Record that training (re)starts after ``step``, so TensorBoard drops older events
    at later steps that a crashed or abandoned run wrote.

    TensorBoard treats every ``SessionLog.START`` after a run's first one as a restart and
    discards earlier events at or after its step; so every session writes one, at
    ``step + 1``. It goes into its own event file whose name sorts before the writer's
    next file (same timestamp prefix, then "+" before any host name), so it is read in
    between the old events and the new ones. That order holds only if its timestamp is
    later than every older event file's: within the second an earlier session's file was
    made (a short run resumed at once), "+session" would sort before that file and the
    restart would be read first, purging nothing. It then waits for the next second.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    newest = max(map(_event_file_second, log_dir.glob("events.out.tfevents.*")), default=-1)
    now = time.time()
    if int(now) <= newest:
        time.sleep(newest + 1 - now)
        now = time.time()
    name = f"events.out.tfevents.{int(now)}.{SESSION_MARK}.{step}.start"
    with tf.io.TFRecordWriter(str(log_dir / name)) as records:
        records.write(
            event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString()
        )
        start = event_pb2.Event(wall_time=now, step=step + 1)
        start.session_log.status = event_pb2.SessionLog.START
        records.write(start.SerializeToString())


def _event_file_second(path: Path) -> int:
    """The whole second in an event file's name (``events.out.tfevents.<second>.<rest>``),
    by which TensorBoard orders a run's files; -1 for a name without one."""
    field = path.name.split(".")[3:4]
    return int(field[0]) if field and field[0].isdigit() else -1
