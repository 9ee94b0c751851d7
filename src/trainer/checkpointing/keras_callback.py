"""``Checkpoint``: the checkpoint callback, for any ``model.fit`` and for ``train(cfg)``.

It decides *when* to save (every N steps, every N epochs, at the end of training, on an
interrupt) and hands each save to a ``CheckpointManager``, which names, writes, points
``latest`` at and prunes them.

In your own script (``Checkpoint(directory, ...)``) it counts steps and epochs itself, and
with ``resume="auto"`` the ``fit`` of a re-run script starts from the newest checkpoint of
``directory``: weights, every optimizer variable (the step count that drives learning-rate
schedules, the rate ReduceLROnPlateau lowered), Keras' RNG seed states, NumPy's global RNG,
the epoch (``fit`` starts there) and, for a checkpoint taken mid-epoch, the step: Keras
cannot start an epoch in its middle, so the resumed epoch's first batches run once more and
the checkpoint's values (metric sums included) are put back after the last of them; the
next batch then continues exactly, as long as the epoch yields its batches in the same
order as before (``shuffle=False``, or a pipeline whose order depends on the epoch alone).

In ``train(cfg)`` it shares the loop's ``TrainingState`` and ``RunProgress`` (steps,
interrupts) and ``train`` restores before ``fit``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from trainer._compat.keras_training import (
    before_finalizing,
    innermost_optimizer,
    set_initial_epoch,
)
from trainer.checkpointing.callback_state import keeps_state, load_state, state_of
from trainer.checkpointing.manager import CheckpointManager, batches_trained
from trainer.checkpointing.policy import CheckpointPolicy, scalar_metrics
from trainer.checkpointing.restoring import numpy_rng_record, set_numpy_rng
from trainer.checkpointing.shadow import all_variables
from trainer.checkpointing.snapshot import ValueReader
from trainer.errors import ConfigError, TrainerError, TrainingDivergedError
from trainer.state import TrainingState

log = logging.getLogger(__name__)

RESUME = ("auto", "never")


class Checkpoint(keras.callbacks.Callback):
    """Checkpoints for ``model.fit``; resumes a re-run script where it stopped.

    Also ``trainer.callbacks.Checkpoint``. Restored on a re-run (``resume="auto"``): the
    weights, every optimizer variable, Keras's RNG seed states, NumPy's global RNG, the
    epoch and the step; a mid-epoch checkpoint replays the epoch's first batches and puts
    the checkpoint's values back after them.

    Args:
        directory: The checkpoint directory (or give ``manager``).
        backend: A registered backend name or a backend instance.
        resume: ``"auto"`` (continue from the newest whole checkpoint, if any) or
            ``"never"``.
        track: Callbacks by name (``{"early_stopping": early_stopping}``) whose state travels
            with every checkpoint: ``EarlyStopping``, ``ReduceLROnPlateau`` or any class
            with ``state_dict()`` / ``load_state_dict(state)``, placed before this callback
            in ``fit(callbacks=[...])``.
        manager: A ``CheckpointManager`` to save through, instead of ``directory``,
            ``backend`` and the policy options.
        state: The training state to continue (``train(cfg)`` passes its own).
        progress: ``train(cfg)``'s step counter; None in a plain script.
        callback_state: Returns the state of other callbacks to save (``train(cfg)``).
        **policy: ``CheckpointPolicy`` fields: ``every_n_steps``, ``every_n_epochs`` (1),
            ``keep_last`` (3), ``keep_best`` (1), ``monitor``, ``mode``,
            ``keep_every_n_epochs``, ``name``, ``async_save``, ``on_save_error``,
            ``on_train_end``, ``on_interrupt``.

    Raises:
        ConfigError: Both or neither of ``directory`` and ``manager``; ``resume`` not
            ``"auto"`` or ``"never"``; a policy value of the wrong type; a tracked callback
            that keeps no readable state or comes after this one (when training starts); a
            ``monitor`` the run does not log (when training starts, unless ``keep_best=0``).
        TrainingDivergedError: The loss became NaN or infinite: nothing more is saved and
            training stops, naming the newest finite checkpoint.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        backend: Any = "savedmodel",
        *,
        resume: str = "auto",
        track: dict[str, keras.callbacks.Callback] | None = None,
        manager: CheckpointManager | None = None,
        state: TrainingState | None = None,
        progress: Any = None,
        callback_state: Callable[[], dict[str, Any]] | None = None,
        **policy: Any,
    ):
        super().__init__()
        if (directory is None) == (manager is None) or (manager is not None and policy):
            raise ConfigError(
                "Checkpoint needs a directory (with the backend and policy options), or a "
                "CheckpointManager that has them, not both. Received: "
                f"directory={directory!r}, manager={manager!r}, options={sorted(policy)}"
            )
        if resume not in RESUME:
            raise ConfigError(
                f"Checkpoint(resume=...) must be 'auto' (continue from the newest checkpoint "
                f"of the directory) or 'never'. Received: {resume!r}"
            )
        self.manager = manager or CheckpointManager(directory, backend, make_policy(policy))
        self.policy = self.manager.policy
        self.resume = resume
        if track is not None and not isinstance(track, dict):
            raise ConfigError(
                f"Checkpoint's track must be a dict naming each callback whose state the "
                f"checkpoints carry, e.g. track={{'early_stopping': EarlyStopping(...)}}. "
                f"Received: {type(track).__name__}"
            )
        self.track = _trackable(dict(track or {}))
        self._began: set[str] = set()  # tracked callbacks whose on_train_begin ran this fit
        for name, callback in self.track.items():
            _report_begin(callback, name, self._began)
        self.state = state  # None: this callback counts (standalone); else the loop's
        self.standalone = state is None
        self.progress = progress  # the loop's RunProgress (interrupts), if any
        self.callback_state = callback_state
        self._pending_logs: dict[str, Any] | None = None
        self._replay = 0  # batches of the resumed epoch to run again before continuing
        self._replay_values: list[Any] | None = None
        self._read_metrics = ValueReader()  # the metrics' accumulators, at every save
        self._tracked_after_replay: dict[str, Any] = {}
        self._unhook: Callable[[], None] | None = None  # see on_train_begin (EMA)
        self._batches = BatchCounter()

    # ------------------------------------------------------------- standalone
    def on_train_begin(self, logs=None):
        self._refuse_tracked_after_me()
        if self.standalone:
            self._begin_standalone()
        if self.policy.every_n_epochs or self.policy.every_n_steps or self.policy.on_train_end:
            self.manager.prepare(self.model)  # saves are due: their one-time work starts now
        self._unhook_finalize()
        optimizer = getattr(self.model, "optimizer", None)
        if getattr(innermost_optimizer(optimizer), "use_ema", False):
            # fit replaces the weights by their moving averages before on_train_end: the
            # final save is made just before, with the weights training continues from.
            self._unhook = before_finalizing(optimizer, self.finish)

    def _refuse_tracked_after_me(self) -> None:
        """Tracked callbacks must run before this one: a save at an epoch end would hold
        their state of the epoch before (EarlyStopping stopping an epoch late after a
        resume), and batches replayed after a mid-epoch resume would reach them after
        their state was put back. Keras runs callbacks in list order, so each tracked one
        must have begun this fit before this callback does."""
        late = sorted(set(self.track) - self._began)
        self._began.clear()
        if late:
            raise ConfigError(
                f"The callbacks tracked by Checkpoint ({', '.join(late)}) must come before it "
                f"in fit(callbacks=[...]), and be in that list: after it, each checkpoint "
                f"would hold their state of the step before, and a resumed run would differ. "
                f"Put them first, e.g. callbacks=[{late[0]}, ..., checkpoint]. "
                f"Received: {late} after the Checkpoint or not passed to fit"
            )

    def _begin_standalone(self) -> None:
        self._pending_logs = None
        latest = self.manager.latest_whole() if self.resume == "auto" else None
        if latest is None:
            self.state = TrainingState(global_step=batches_trained(self.model) or 0)
            return
        self.state = self.manager.restore(self.model, latest).state
        self.manager.set_aside_after(self.state.global_step)  # damaged newer ones skipped
        # The tracked callbacks ran their on_train_begin (which resets them) before this
        # one (``_refuse_tracked_after_me``): their state goes back now, and again after a
        # mid-epoch resume's replayed batches (``_end_replay``).
        self._restore_tracked(self.state.callbacks)
        self._tracked_after_replay = dict(self.state.callbacks)
        epoch = self.state.epoch
        if self.state.stopped_early:
            epoch = max(epoch, int(self.params.get("epochs") or epoch))  # nothing left to do
        set_initial_epoch(self.model, epoch)
        if self.state.step_in_epoch:
            self._replay = self.state.step_in_epoch
            self._replay_values = [keras.ops.convert_to_numpy(v) for v in all_variables(self.model)]
        log.info(
            "Resuming from %s at epoch %d, step %d (+%d in epoch)",
            latest,
            self.state.epoch,
            self.state.global_step,
            self.state.step_in_epoch,
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._batches.reset()

    def _restore_tracked(self, states: dict[str, Any]) -> None:
        for name, callback in self.track.items():
            if name in states:
                load_state(name, callback, states[name])

    def _end_replay(self) -> None:
        """The resumed epoch's already-trained batches ran again: put the checkpoint back."""
        for variable, value in zip(all_variables(self.model), self._replay_values, strict=True):
            variable.assign(value)
        sums = self.state.metric_variables
        for variable, value in zip(self.model.metrics_variables, sums, strict=False):
            variable.assign(value)
        set_numpy_rng(self.state.numpy_rng)
        self._replay, self._replay_values = 0, None
        # The replayed batches reached the tracked callbacks too (Keras calls every
        # callback): their state as the checkpoint holds it, again.
        tracked, self._tracked_after_replay = self._tracked_after_replay, {}
        self._restore_tracked(tracked)

    # --------------------------------------------------------------- triggers
    def on_train_batch_begin(self, batch, logs=None):
        if self._pending_logs is not None:
            self.save(self._pending_logs)

    def on_train_batch_end(self, batch, logs=None):
        trained = self._batches.advance(batch, self.params.get("steps"))
        if self._replay:
            if batch + 1 >= self._replay:
                self._end_replay()
            return
        if self.standalone:
            self.state.global_step += trained
            self.state.step_in_epoch += trained
        if self.interrupted:
            self._save_on_interrupt(logs)
            return
        every = self.policy.every_n_steps
        step = self.state.global_step  # a multiple of every_n_steps was reached or passed
        if every and step // every > (step - trained) // every:
            self._pending_logs = dict(logs or {})

    def on_epoch_end(self, epoch, logs=None):
        if self._replay:
            raise TrainerError(
                f"The resumed epoch {epoch + 1} ended before the {self._replay} batches its "
                f"checkpoint was taken after: the data is not the one the checkpoint was "
                f"trained on. Resume with the same data, or remove the checkpoints in "
                f"{self.manager.directory}. Received: an epoch shorter than {self._replay} batches"
            )
        if self.standalone:
            self.state.epoch = epoch + 1
            self.state.step_in_epoch = 0
            self.state.metrics = scalar_metrics(logs)
        self.manager.report_saved()  # the bar's line for this epoch is complete
        if self.interrupted:
            self._save_on_interrupt(logs)
            return
        every = self.policy.every_n_epochs
        if self._pending_logs is not None or (every and self.state.epoch % every == 0):
            self.save(logs)
        self.manager.report_saved()

    def on_train_end(self, logs=None):
        self._unhook_finalize()
        self.finish()
        if self.standalone:
            set_initial_epoch(self.model, None)  # a later fit starts where its caller says

    def _unhook_finalize(self) -> None:
        unhook, self._unhook = self._unhook, None
        if unhook is not None:
            unhook()

    def finish(self) -> None:
        """End of training: the final save (if due), then wait for any write in flight."""
        if self._pending_logs is not None or (self.policy.on_train_end and not self.interrupted):
            self.save(self._pending_logs or self.state.metrics, wait=True)
        self.manager.wait()
        self.manager.release()  # on a store: its writer's lease; a later fit takes it again

    @property
    def interrupted(self) -> bool:
        return bool(self.progress is not None and self.progress.interrupted)

    def _save_on_interrupt(self, logs) -> None:
        if self.policy.on_interrupt:
            self.save(logs, wait=True)
        self.manager.report_saved()

    # ------------------------------------------------------------------- save
    def save(self, logs: dict[str, Any] | None, *, wait: bool = False):
        """Save now, with what only the live run knows in the state: metric sums (for a
        mid-epoch resume), NumPy's RNG, callbacks' state, whether a callback ended the run."""
        called = time.perf_counter()  # the save holds the loop from here
        self._pending_logs = None
        state = self.state
        values = self._read_metrics(self.model.metrics_variables)
        self._refuse_diverged(values, logs)
        state.metric_variables = [value.tolist() for value in values]
        state.numpy_rng = numpy_rng_record()
        states = dict(self.callback_state() if self.callback_state else {})
        for name, callback in self.track.items():
            own = state_of(callback)
            if own is not None:
                states[name] = own
        state.callbacks = states
        # A callback (EarlyStopping) ended the run: resuming from here has nothing to do.
        state.stopped_early = bool(self.model.stop_training and not self.interrupted)
        return self.manager.save(self.model, self.state, metrics=logs, wait=wait, called=called)

    def _refuse_diverged(self, values: list[Any], logs: dict[str, Any] | None) -> None:
        """Like Keras's ``TerminateOnNaN``, but before anything is written: a NaN or
        infinite loss (its running sum is among the metric variables, read for the state
        anyway) means the weights are no longer finite. Saving them would let retention
        delete the finite checkpoints for checkpoints nothing can resume from usefully."""
        loss = (logs or {}).get("loss")
        finite = all(np.isfinite(value).all() for value in values)
        if finite and (loss is None or np.isfinite(np.asarray(loss, dtype="float64")).all()):
            return
        self.model.stop_training = True
        newest = self.manager.latest()
        raise TrainingDivergedError(
            f"Training diverged: the loss became NaN or infinite by epoch {self.state.epoch}, "
            f"step {self.state.global_step}. No checkpoint was written from these weights; "
            f"the newest finite one is {newest or 'none (none was saved before)'}, kept "
            f"with every other. Lower the learning rate or check the data, then resume from "
            f"a finite checkpoint (resume=PATH) or start afresh. Received loss={loss}"
        )


class BatchCounter:
    """Steps trained between two ``on_train_batch_end`` calls of an epoch: one, or up to
    ``steps_per_execution`` (Keras then reports once per execution, with the index of its
    last batch); counting calls counted a third of the steps at 3. An epoch's last
    execution may run fewer steps than that index says (Keras reports ``begin +
    steps_per_execution - 1`` for it too: 8 for an epoch of 7 steps at 3), so the index is
    capped at the epoch's steps where Keras knows them (``params["steps"]``)."""

    def __init__(self):
        self.ended = 0  # batches of this epoch reported so far

    def reset(self) -> None:
        """At each epoch's begin: Keras' batch index starts again at 0."""
        self.ended = 0

    def advance(self, batch: int, steps: int | None) -> int:
        ended = min(batch + 1, steps) if steps else batch + 1
        trained, self.ended = ended - self.ended, ended
        return trained


def _trackable(track: dict[str, keras.callbacks.Callback]) -> dict[str, keras.callbacks.Callback]:
    """``track`` if every entry keeps state trainer can read, else a ``ConfigError``."""
    stateless = sorted(name for name, callback in track.items() if not keeps_state(callback))
    if stateless:
        raise ConfigError(
            f"Checkpoint(track=...) can carry only callbacks whose state it can read: "
            f"EarlyStopping, ReduceLROnPlateau, or a class defining state_dict() and "
            f"load_state_dict(state). Define those methods, or leave these out of track. "
            f"Received without state: {stateless}"
        )
    return track


def _report_begin(callback: keras.callbacks.Callback, name: str, began: set[str]) -> None:
    """Note in ``began`` when ``callback``'s ``on_train_begin`` runs (shadows the method on
    the instance; the callback's own runs as before)."""
    own = callback.on_train_begin

    def on_train_begin(logs=None):
        began.add(name)
        return own(logs)

    callback.on_train_begin = on_train_begin


def make_policy(options: dict[str, Any]) -> CheckpointPolicy:
    """``CheckpointPolicy(**options)``; an unknown option is a ``ConfigError`` naming them."""
    try:
        return CheckpointPolicy(**options)
    except TypeError as error:
        known = sorted(CheckpointPolicy.__dataclass_fields__)
        raise ConfigError(
            f"Unknown checkpoint option: {error}. The options are {', '.join(known)}. "
            f"Received: {sorted(options)}"
        ) from None
