"""The save path of ``CheckpointManager``: a save's record and name, its write (now, or in
the writer thread when async), the ``latest`` pointer, retention after each write, a failed
write's handling, and how long each save held the training thread.

Split from ``manager.py`` so that the manager's module keeps its public surface (queries,
restore, lifecycle) and this one the machinery behind ``CheckpointManager.save``. The
methods live on a base class (``SavePath``) rather than as functions taking the manager
because they read and update its state (``records``, ``saved``, ``failed``) as one unit,
and because ``benchmarks/async_cost.py`` replaces ``CheckpointManager._write`` to measure
stand-in writers. Log lines keep the manager's logger name: the documentation's console
samples show it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from trainer._compat import keras_training as training_compat
from trainer.checkpointing import on_store
from trainer.checkpointing.listing import point_latest
from trainer.checkpointing.policy import CheckpointPolicy, format_name, retained, scalar_metrics
from trainer.checkpointing.snapshot import copy_state
from trainer.errors import ConfigError, SaveError
from trainer.save_backends import early_files
from trainer.save_backends.base import SaveBackend
from trainer.state import TrainingState, copy_json_like
from trainer.storage.early import EarlyUploads
from trainer.storage.lease import Lease
from trainer.storage.locks import remove_unless_read
from trainer.storage.remote import RemoteCheckpoints
from trainer.tensorboard.board import LINK_KEY, RunBoard, card_tag

# The manager's logger (``trainer.checkpointing.manager``): its lines predate this split and
# appear, under that name, in the tutorials' console samples.
log = logging.getLogger("trainer.checkpointing.manager")


@dataclasses.dataclass
class CheckpointWrite:
    """One checkpoint's write, as ``SavePath._save`` hands it to the backend's ``submit``:
    which backend writes which model (a snapshot of it when async), where, with which
    training state and metadata. One object, so that the write and its publication take
    the same arguments by name rather than repeating a parameter list."""

    writer: SaveBackend
    model: keras.Model
    path: Path
    state: TrainingState
    metadata: dict[str, Any]


class SavePath:
    """``CheckpointManager``'s save and write machinery; the manager sets every attribute
    below in its ``__init__``. Not meant to be used on its own."""

    directory: Path
    backend: SaveBackend
    policy: CheckpointPolicy
    metadata: dict[str, Any]
    board: RunBoard | None
    remote: RemoteCheckpoints | None
    lease: Lease | None
    records: list[dict[str, Any]]
    saved: list[Path | str]
    failed: list[Path]
    _last_saved_step: int | None
    _done: list[tuple[Path | str, int, float]]
    _done_lock: threading.Lock
    after_publish: list[Callable[[], Any]]

    def _save(
        self,
        model: keras.Model,
        state: TrainingState | None,
        metrics: dict[str, Any] | None,
        wait: bool,
        called: float | None,
    ) -> Path | str | None:
        """``CheckpointManager.save`` (which documents it): the record, the name, the
        submission of the write, the blocking time."""
        called = time.perf_counter() if called is None else called
        if state is not None and not isinstance(state, TrainingState):
            raise ConfigError(
                f"CheckpointManager.save's state must be a trainer.state.TrainingState (or "
                f"None: the step is the optimizer's). Received: {type(state).__name__}"
            )
        state = state if state is not None else self._implicit_state(model)
        if self._last_saved_step == state.global_step:
            return None
        self._last_saved_step = state.global_step
        self.backend.wait()  # one write in flight; its retention applied; raises its failure
        if self.lease is not None:  # taken, or renewed; refused if another writer has it
            self.lease.hold()  # after the previous upload: the expiry counts from its end
        metrics = scalar_metrics(metrics)
        name = format_name(
            self.policy.name, step=state.global_step, epoch=state.epoch, metrics=metrics
        )
        path = Path(self.backend.checkpoint_path(self.directory / name))
        record = {
            "name": path.name,
            "step": state.global_step,
            "epoch": state.epoch,
            "epoch_end": state.step_in_epoch == 0,
            "monitor": metrics.get(self.policy.monitor),
        }
        self.records = [*(r for r in self.records if r["name"] != path.name), record]
        saved_state = copy_state(state)
        saved_state.checkpoints = copy_json_like(self.records)
        metadata = copy_json_like(self.metadata)
        blocked = Blocking(called)
        self.backend.submit(  # now, or in the background with a copy of the model
            model,
            lambda writer, snap: self._write(
                CheckpointWrite(writer, snap, path, saved_state, metadata), blocked
            ),
        )
        blocked.done()  # before any wait: a background write reads it
        if wait:
            self.backend.wait()
        return self.remote.url_of(path.name) if self.remote is not None else path

    def _implicit_state(self, model: keras.Model) -> TrainingState:
        step = batches_trained(model)
        if step is None:
            step = max((r["step"] for r in self.records), default=-1) + 1
        return TrainingState(global_step=step)

    def _write(self, job: CheckpointWrite, blocked: Blocking) -> None:
        """Write one checkpoint (``job``: in the writer thread when async), then
        ``latest``, retention and the TensorBoard card. ``blocked``: how long the save held
        the training thread."""
        writer, path, state, metadata = job.writer, job.path, job.state, job.metadata
        start = time.perf_counter()
        if self.board is not None:
            tag = card_tag("checkpoint", path.name)
            metadata[LINK_KEY] = self.board.link(state.global_step, path, tag=tag)
        try:
            self._write_and_publish(job)
        except Exception as error:
            self.records = [r for r in self.records if r["name"] != path.name]
            self._failed(path, error)
            return
        seconds = time.perf_counter() - start
        # The checkpoint is complete: point at it and prune first, so that a TensorBoard
        # card that fails to write (on_save_error=raise) cannot leave ``latest`` behind.
        if self.remote is not None:  # ``latest`` was pointed by ``publish``
            self.saved.append(self.remote.url_of(path.name))
        else:
            self.saved.append(path)
            point_latest(self.directory, path)
        self._after_publish()
        deleted = self._apply_retention()
        with self._done_lock:
            self._done.append((self.saved[-1], state.global_step, seconds))
        if self.board is not None:
            self.board.checkpoint_card(
                state.global_step,
                path,
                backend=writer.name,
                format_version=writer.format_version,
                save_seconds=seconds,  # the size: the card measures it, if the path is kept
                blocking_seconds=blocked.seconds(),
                metrics=state.metrics,
            )
            for name in deleted:
                self.board.checkpoint_deleted(state.global_step, name)

    def _write_and_publish(self, job: CheckpointWrite) -> None:
        """The local write, then (on a store) the upload and ``latest``. The intent record
        and the look for an earlier checkpoint of the same name go on while the backend
        writes the local copy (``RemoteCheckpoints.begin``), and so do the uploads of the
        files the backend finishes early (``trainer.storage.early``: a large model's
        variables); nothing is deleted, and nothing is listed (the marker), before the
        local copy is complete. A failed write deletes what was uploaded early."""
        writer, model, path, state = job.writer, job.model, job.path, job.state
        if self.remote is None:
            writer.save(model, path, state=state, metadata=job.metadata)
            return
        begun = self.remote.begin_in_background(path.name)
        early = EarlyUploads(self.remote.store, path.name, begun) if writer.is_directory else None
        try:
            with early_files.listening(early.add if early is not None else None):
                writer.save(model, path, state=state, metadata=job.metadata)
        except BaseException:
            uploaded = early.keys() if early is not None else []
            if wait_quietly(begun):
                try:
                    self.remote.abandon(path.name, uploaded)  # nothing listed was changed
                except Exception as error:  # the next writer cleans the objects, the record
                    log.warning("Could not remove %s's early objects: %s", path.name, error)
            raise
        self.remote.publish(
            path,
            step=state.global_step,
            epoch=state.epoch,
            begun=begun,
            latest=True,
            early=early,
        )

    def _after_publish(self) -> None:
        """Run ``after_publish`` (set by the caller: a run whose TensorBoard log goes to a
        store uploads it there) once a checkpoint is complete (on a store: published). A
        failure is logged: the checkpoint is complete, and the caller's own end-of-run
        upload raises if the store stays unreachable."""
        for hook in self.after_publish:
            try:
                hook()
            except Exception as error:
                log.warning("After publishing a checkpoint: %s", error)

    def _failed(self, path: Path, error: Exception) -> None:
        failure = error
        if not isinstance(error, SaveError):
            failure = SaveError(
                f"Saving checkpoint {path} failed: {error}. The previous checkpoints in "
                f"{self.directory} are intact; free space or fix permissions and resume from "
                f"the latest one. Received error type {type(error).__name__}"
            )
        if self.policy.on_save_error == "continue":
            self.failed.append(path)
            log.error("%s Training continues (checkpoint.on_save_error=continue).", failure)
            return
        if failure is error:
            raise error
        raise failure from error

    def _apply_retention(self) -> list[str]:
        """Delete what the policy no longer keeps, atomically; a checkpoint a reader is
        loading right now stays (with its record) until a later pass. Returns the names
        deleted."""
        keep = retained(self.records, self.policy)
        if self.remote is not None:
            gone = on_store.prune(self.remote, self.directory, self.records, keep)
            self.records = [r for r in self.records if r["name"] not in gone]
            return gone
        gone = {
            r["name"]
            for r in self.records
            if r["name"] not in keep and remove_unless_read(self.directory / r["name"])
        }
        self.records = [r for r in self.records if r["name"] not in gone]
        return sorted(gone)


def batches_trained(model: keras.Model) -> int | None:
    """The batches ``model``'s optimizer has been applied on (its step count; the batch
    count under gradient accumulation, where two saves a batch apart hold different
    accumulated gradients); None if it has no built optimizer."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    return int(keras.ops.convert_to_numpy(training_compat.batches_trained(optimizer)))


class Blocking:
    """How long a save held the training thread (from ``called``), handed to its write. A
    write in the training thread held it until now; a background write can start before
    ``save`` returns, so its card waits for the figure ``done`` sets."""

    def __init__(self, called: float):
        self._called = called
        self._thread = threading.get_ident()
        self._set = threading.Event()
        self._seconds = 0.0

    def done(self) -> None:
        self._seconds = time.perf_counter() - self._called
        self._set.set()

    def seconds(self) -> float:
        if threading.get_ident() == self._thread and not self._set.is_set():
            return time.perf_counter() - self._called  # written in the training thread
        self._set.wait()
        return self._seconds


def wait_quietly(future: Any) -> bool:
    """Wait for ``future`` to finish; whether it succeeded (its error is not raised)."""
    try:
        return future.exception() is None
    except BaseException:
        return False
