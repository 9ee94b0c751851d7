"""``CheckpointManager``: the checkpoints of one directory, for any Keras training code.

It owns everything about checkpoints that does not depend on *when* they are taken: names
(``policy.name``), retention (last N, best K by a monitored value, every M-th epoch), the
``latest`` pointer, async writes (an ``AsyncBackend`` around the backend), cleanup of
temporaries a crash left behind, listing and restoring. The Keras callback
(``trainer.checkpointing.keras_callback.Checkpoint``) decides when; ``train(cfg)`` wires both.

    with CheckpointManager("ckpt", backend="weights", policy=CheckpointPolicy(keep_last=2)) as m:
        m.save(model)                    # step = the optimizer's iteration count
        m.restore(model)                 # the newest complete one, into an existing model
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from trainer.checkpointing import on_store, set_aside
from trainer.checkpointing.listing import complete, find_latest
from trainer.checkpointing.policy import CheckpointPolicy
from trainer.checkpointing.restoring import restore_into
from trainer.checkpointing.set_aside import ABANDONED
from trainer.checkpointing.wrappers import AsyncBackend, innermost
from trainer.checkpointing.writing import SavePath, batches_trained
from trainer.errors import ConfigError, CorruptCheckpointError, NotACheckpointError
from trainer.save_backends import LoadedCheckpoint, get_backend, load_checkpoint
from trainer.save_backends.base import SaveBackend
from trainer.state import TrainingState, check_record
from trainer.storage.atomic import clean_stale_temporaries
from trainer.storage.cache import staging_dir
from trainer.storage.lease import Lease
from trainer.storage.locations import is_remote, local_path
from trainer.storage.locks import remove_dead_leases
from trainer.storage.remote import RemoteCheckpoints
from trainer.tensorboard.board import RunBoard

log = logging.getLogger(__name__)

# Imported from here by other modules and tests (``trainer.checkpointing`` re-exports the first).
__all__ = ["ABANDONED", "CheckpointManager", "batches_trained"]


class CheckpointManager(SavePath):
    """Saves, lists, restores and prunes the checkpoints of one directory.

    It owns naming, retention (last N, best K by a monitored value, every M-th epoch), the
    ``latest`` link, async writes and the cleanup of temporaries a crash left behind (done
    when it is made). No Hydra needed; ``train(cfg)`` and the ``Checkpoint`` callback use it.
    A context manager: leaving the ``with`` block waits for the writes in flight.

    ``directory`` may be a URL on object storage (``s3://bucket/run/checkpoints``): each
    checkpoint is written by the backend into the local ``staging`` directory as on disk,
    then uploaded and published by its commit marker (``trainer.storage.remote``), in the
    writer thread when async. Listing, ``latest``, restore and retention then work on the
    store; their paths are URLs (strings).

    Args:
        directory: The checkpoint directory (created on the first save): a local path or an
            ``s3://`` URL.
        backend: A registered name (``"savedmodel"``, ``"h5"``, ``"weights"``) or a backend
            instance, wrappers included.
        policy: Names and retention (its trigger fields are the callback's business). Async
            writing (``policy.async_save``; None = the backend's default) wraps the backend
            in ``AsyncBackend``.
        metadata: Added to every checkpoint's metadata.
        board: A run's TensorBoard log (``RunBoard``), which gets a card and a link per
            checkpoint.
        staging: Where checkpoints for a URL ``directory`` are written before the upload
            (default: one folder per URL under ``~/.cache/trainer/staging``).

    Raises:
        ConfigError: An argument of the wrong type.
        UnknownBackendError: ``backend`` names no registered backend.
        UnsupportedLocationError: ``directory`` is a URL of a scheme trainer cannot use.
        StoreError: ``directory`` is on a store that cannot be reached, or its bucket is
            missing or refuses the credentials.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        backend: str | SaveBackend = "savedmodel",
        policy: CheckpointPolicy | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        board: RunBoard | None = None,
        staging: str | os.PathLike | None = None,
    ):
        _check_arguments(directory, backend, policy, metadata)
        self.remote: RemoteCheckpoints | None = None
        self.lease: Lease | None = None  # one writer per URL: taken at the first write
        if is_remote(directory):
            self.remote = RemoteCheckpoints(os.fspath(directory))
            remote = self.remote  # taking the lease cleans a killed writer's leftovers
            self.lease = Lease(remote.store, on_acquire=lambda: on_store.clean(remote))
            self.remote.store.check_bucket()  # a wrong URL fails now, not at the first save
            staging = staging if staging is not None else staging_dir(self.remote.url)
        self.directory = local_path(
            staging if self.remote is not None else directory, "checkpoint directory"
        )
        self.policy = policy or CheckpointPolicy()
        backend = get_backend(backend) if isinstance(backend, str) else backend
        async_save = self.policy.async_save
        if async_save is None:
            async_save = backend.async_by_default
        if async_save and not backend.writes_in_background:
            backend = AsyncBackend(backend)
        self.backend = backend
        self.metadata = dict(metadata or {})
        self.board = board
        self.records: list[dict[str, Any]] = []  # retention: one per kept checkpoint
        # Called after each checkpoint is written (on a store: published), from the writer
        # thread: a run copying its TensorBoard log to a store uploads it then.
        self.after_publish: list[Callable[[], Any]] = []
        self.saved: list[Path | str] = []  # written by this manager, in order (URLs: remote)
        self.failed: list[Path] = []  # saves that failed under on_save_error=continue
        self._last_saved_step: int | None = None
        # "Saved checkpoint" lines wait here for the training thread (report_saved): a
        # background write that logged itself would land in the middle of a progress bar.
        self._done: list[tuple[Path | str, int, float]] = []
        self._done_lock = threading.Lock()
        for stale in clean_stale_temporaries(self.directory):
            log.warning("Removed an incomplete checkpoint left by a crash: %s", stale)
        for lease in remove_dead_leases(self.directory):
            log.info("Removed the read lease of a reader that died: %s", lease.name)

    # ------------------------------------------------------------------ queries
    def all(self) -> list[Path | str]:
        """Every complete checkpoint in the directory.

        Returns:
            Their paths (URLs on a store), oldest (lowest step) first.
        """
        if self.remote is not None:
            return [self.remote.url_of(m["name"]) for m in self.remote.committed()]
        return [path for _, path in complete(self.directory, self._configured())]

    def latest(self) -> Path | str | None:
        """The complete checkpoint with the highest step, its digests unchecked.

        Returns:
            Its path (URL on a store), or None if there is none.
        """
        if self.remote is not None:
            found_remote = self.all()
            return found_remote[-1] if found_remote else None
        found = complete(self.directory, self._configured())
        return found[-1][1] if found else None

    def latest_whole(self) -> Path | str | None:
        """The newest checkpoint whose files match their manifest.

        Damaged newer ones are skipped with a warning (``find_latest``). On a store: the
        newest complete one (its objects are checked against the marker when it is read).

        Returns:
            Its path (URL on a store), or None if the directory holds no checkpoint.

        Raises:
            CorruptCheckpointError: Every checkpoint in the directory is damaged.
        """
        if self.remote is not None:
            return self.latest()
        try:
            return find_latest(self.directory, self._configured())
        except NotACheckpointError:
            return None

    def _configured(self) -> type[SaveBackend]:
        """The class of this manager's own backend: it reads what it wrote, registered or
        not (a backend selected by ``save._target_``)."""
        return type(innermost(self.backend))

    # --------------------------------------------------------------------- save
    def save(
        self,
        model: keras.Model,
        state: TrainingState | None = None,
        *,
        metrics: dict[str, Any] | None = None,
        wait: bool = False,
        called: float | None = None,
    ) -> Path | str | None:
        """Save a model as the next checkpoint of the directory, then apply retention.

        Async (``AsyncBackend``): returns once the snapshot is taken; the write goes on in the
        background. The time this call holds the caller (the training loop) is reported per
        save next to the write's own time (TensorBoard ``checkpoint/blocking_seconds``): for an
        async save the wait for the previous write plus the snapshot, for a synchronous one the
        save.

        Args:
            model: The model to save.
            state: Its training state; default: step = the optimizer's iterations.
            metrics: Values for the name pattern and the ``monitor`` of ``keep_best``.
            wait: Return only once the write is on disk.
            called: The ``time.perf_counter()`` at which the caller began the save (e.g. the
                callback, gathering the state), if before this call: counted as held too.

        Returns:
            The checkpoint's path (its URL on a store), or None if this step is saved
            already.

        Raises:
            ConfigError: ``state`` is not a ``TrainingState``, or the name pattern needs a
                value this save does not have.
            SaveError: The write failed (with ``policy.on_save_error="raise"``), or a
                background write before it did; ``DiskFullError`` and ``SavePermissionError``
                are ``SaveError``s. The previous checkpoints are intact.
            ModelNotReadyError: The backend refuses the model (never built, ...).
        """
        return self._save(model, state, metrics, wait, called)

    def report_saved(self) -> None:
        """Log the saves completed since the last call; call it from the training thread
        where a line may start (the callback does so at epoch ends)."""
        with self._done_lock:
            done, self._done = self._done, []
        for path, step, seconds in done:
            log.info("Saved checkpoint %s (step %d) in %.2fs", path, step, seconds)

    # ------------------------------------------------------------------ restore
    def restore(
        self, model: keras.Model | None = None, path: str | os.PathLike | None = None
    ) -> LoadedCheckpoint:
        """Load a checkpoint into a model, or as a new model, and continue from it.

        Retention continues from the checkpoint's records.

        Args:
            model: A model of the same architecture to copy every variable into (the
                optimizer's included, and NumPy's global RNG); None: the loaded model.
            path: The checkpoint; default: the newest whole one (``latest_whole``).

        Returns:
            The ``LoadedCheckpoint``, its ``model`` being ``model`` when one was given.

        Raises:
            NotACheckpointError: The directory holds no complete checkpoint.
            CorruptCheckpointError: Every checkpoint is damaged, or its retention records name
                paths outside the directory.
            ConfigMismatchError: ``model`` does not have the checkpoint's variables.
            TrainerError: Whatever ``load_checkpoint`` raises for it.
        """
        self.backend.wait()
        if path is None:
            path = self.latest_whole()
            if path is None:
                where = self.remote.url if self.remote is not None else str(self.directory)
                raise NotACheckpointError(
                    f"There is no complete checkpoint in {where} to restore; save one "
                    f"first, or point the manager at the directory holding them. "
                    f"Received: directory={where!r}"
                )
        checkpoint = load_checkpoint(path, configured=self._configured())
        if model is not None:
            restore_into(model, checkpoint)
            checkpoint = dataclasses.replace(checkpoint, model=model)
        self.adopt(checkpoint.state)
        return checkpoint

    def adopt(self, state: TrainingState) -> None:
        """Continue from a restored ``state``: its retention records; its step is saved.

        Each record names a checkpoint retention may delete: checked again here, since a
        state may be built by hand as well as read from a checkpoint (``check_record``).

        Args:
            state: The training state of the checkpoint training continues from.

        Raises:
            CorruptCheckpointError: A retention record names no checkpoint of this
                directory (nothing outside it is ever deleted).
        """
        for record in state.checkpoints:
            try:
                check_record(record)
            except ValueError as error:
                raise CorruptCheckpointError(
                    f"The training state to continue from holds a retention record that "
                    f"names no checkpoint of {self.directory}; nothing outside it is ever "
                    f"deleted. Resume from another checkpoint. Received: {error}"
                ) from None
        self.records = copy.deepcopy(state.checkpoints)
        self._last_saved_step = state.global_step

    def set_aside_after(self, step: int) -> Path | None:
        """Training continues from a checkpoint at ``step`` older than the directory's
        newest: the checkpoints after it belong to the continuation that is abandoned. They
        are moved, whole, into ``abandoned-<n>/`` of the directory (nothing is deleted), so
        that ``resume=latest`` continues this branch instead of jumping back to that one,
        and no save of this branch replaces one of them under the same name. On a store
        only their markers move (``RemoteCheckpoints.set_aside``); the objects stay.

        Args:
            step: The step of the checkpoint training continues from.

        Returns:
            The ``abandoned-<n>`` folder, or None if there was nothing after ``step``.
        """
        if self.remote is not None:
            self.claim()  # moving markers is writing
            return on_store.set_aside_after(self.remote, step)
        return set_aside.set_aside_after(self.directory, self._configured(), step)

    # ---------------------------------------------------------------- lifecycle
    def prepare(self, model: keras.Model) -> None:
        """Training of ``model`` starts: an async backend builds its shadow copy now and
        warms its writes in the background (``AsyncBackend.prepare``), so that no save of
        the run waits for that one-time work. Writes nothing into the directory.

        Args:
            model: The model about to train.
        """
        self.backend.prepare(model)

    def wait(self) -> None:
        """Return once every write is on disk.

        Raises:
            SaveError: A background write failed.
        """
        try:
            self.backend.wait()
        finally:
            self.report_saved()

    def close(self) -> None:
        """No more saves: wait for the writes in flight (``wait``), then, on a store,
        release the writer's lease (a later save takes it again).

        Raises:
            SaveError: A background write failed.
        """
        try:
            self.wait()
            if self.lease is not None and not self.lease.held:
                return  # wrote nothing on the store: nothing to prune, no lease to hold
            deleted = self._apply_retention()  # what a reader's lease kept in the last pass
        finally:
            self.release()
        if self.board is not None and deleted:
            for name in deleted:
                self.board.checkpoint_deleted(self._last_saved_step or 0, name)

    def claim(self) -> None:
        """On a store: take (or renew) the writer's lease now rather than at the first
        save, so that a second writer is refused before it trains (``train(cfg)`` does).
        Nothing to do on disk.

        Raises:
            DirectoryInUseError: Another live writer holds the directory's lease.
        """
        if self.lease is not None:
            self.lease.hold()

    def release(self) -> None:
        """On a store: give up the writer's lease now (after ``wait``), so that another
        writer may start at once instead of after its expiry. A later save takes it again.
        Nothing to do on disk."""
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # the error already propagating wins; this one is logged
            log.exception("The last checkpoint write failed")


def _check_arguments(directory: Any, backend: Any, policy: Any, metadata: Any) -> None:
    """Wrong argument types fail here, naming the argument, not as a raw error at the
    first save (``backend=object()``) or in a later call."""
    problems = []
    if not isinstance(directory, str | os.PathLike):
        problems.append(("directory", "a path", directory))
    if not isinstance(backend, str | SaveBackend):
        problems.append(("backend", "a backend name or a SaveBackend instance", backend))
    if policy is not None and not isinstance(policy, CheckpointPolicy):
        problems.append(("policy", "a CheckpointPolicy (CheckpointPolicy(**options))", policy))
    if metadata is not None and not isinstance(metadata, dict):
        problems.append(("metadata", "a dict", metadata))
    if problems:
        name, kind, value = problems[0]
        raise ConfigError(
            f"CheckpointManager's {name} must be {kind}. Received: {value!r} "
            f"({type(value).__name__})"
        )
