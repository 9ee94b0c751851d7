"""The contract every save backend fulfils, and the parts they all share.

A backend only implements ``_write`` / ``_read`` and ``can_load``; atomic publication,
metadata, validation of the model and of the path live here once.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as _dt
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import keras
import tensorflow as tf

from trainer.errors import (
    SaveError,
    TrainerError,
)
from trainer.model_state import config_check, readiness, vocabularies
from trainer.model_state.serializables import register_serializables
from trainer.save_backends import load_refusals, naming
from trainer.save_backends.integrity_hooks import IntegrityHooks
from trainer.state import TrainingState
from trainer.storage import integrity, limits, targets
from trainer.storage.atomic import atomic_write, is_temporary, write_error
from trainer.storage.locations import local_path
from trainer.version import __version__


@dataclasses.dataclass
class LoadedCheckpoint:
    """What ``load`` returns: the model and the state it was saved with.

    Named apart from the Keras callback ``trainer.callbacks.Checkpoint``; its former name
    ``trainer.save_backends.Checkpoint`` is kept as an alias.

    Attributes:
        model: The Keras model, compiled as saved (unless loaded with ``compile=False``).
        state: The ``TrainingState``: epoch, global step, step in the epoch, metrics, history.
        metadata: Everything else the checkpoint records: backend, format version, versions,
            the run's config, ``revived_from`` (savedmodel), the TensorBoard link.
        path: The checkpoint actually read (a link such as ``latest`` resolved).
    """

    model: keras.Model
    state: TrainingState
    metadata: dict[str, Any]
    path: Path


# Its former name, kept as an alias: code importing ``trainer.save_backends.Checkpoint`` runs.
Checkpoint = LoadedCheckpoint
"""The former name of ``LoadedCheckpoint``, kept so that code importing it runs."""


class SaveBackend(IntegrityHooks, abc.ABC):
    """Abstract save backend: ``save`` a model with its training state, ``load`` it back.

    Subclasses set ``name`` and ``format_version``, say whether a checkpoint is one file
    (``is_directory = False``, with ``suffix``) or a directory, and implement ``_write``,
    ``_read`` and the class-level ``can_load``. The base class does validation, metadata,
    the manifest and the atomic rename. See docs/how-to/writing-a-backend.md.

    Attributes:
        name: The registered name, recorded in every checkpoint.
        format_version: The format version this backend writes (a major version).
        min_format_version: The oldest format version ``load`` still reads.
        manifest_file: Where a directory checkpoint keeps its manifest; None: none.
        is_directory: Whether a checkpoint is a directory (else one file).
        suffix: A single-file checkpoint's suffix (``".h5"``).
        async_by_default: Whether the checkpoint callback writes in a background thread
            unless told otherwise.
        read_late: Files (``fnmatch`` patterns) ``_read`` reads only after
            ``integrity.await_digests()``: their digests are checked in a thread meanwhile.
        writes_in_background: Whether ``save`` may return before the checkpoint is written
            (the async wrapper); a backend itself never does.
    """

    name: ClassVar[str]
    format_version: ClassVar[int] = 1
    # Oldest format version ``load`` still reads (format versions are major versions).
    min_format_version: ClassVar[int] = 1
    is_directory: ClassVar[bool] = True
    suffix: ClassVar[str] = ""
    # Whether the checkpoint callback writes in a background thread unless told otherwise.
    async_by_default: ClassVar[bool] = False
    # Whether ``save`` may return before the checkpoint is written (``wait`` finishes it):
    # the async wrapper (``trainer.checkpointing.AsyncBackend``); a backend never does.
    writes_in_background: ClassVar[bool] = False

    def __repr__(self) -> str:
        """``H5Backend()``, ``H5Backend(compression='gzip')``: see ``naming.constructor_repr``."""
        return naming.constructor_repr(self)

    # ----------------------------------------------------------------- public API
    def save(
        self,
        model: keras.Model,
        path: str | os.PathLike,
        *,
        state: TrainingState | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Write a model and its training state as a checkpoint.

        The checkpoint is written into a hidden temporary sibling, sealed with its manifest and
        renamed into place: it appears at ``path`` complete or not at all.

        Args:
            model: A built Keras model; its weights, optimizer variables and compile config are
                saved.
            path: Where the checkpoint goes (a file backend adds its ``suffix`` if missing). It
                may replace a trainer checkpoint or an empty directory, nothing else.
            state: The training state to record (epoch, step, metrics); a fresh one if omitted.
            metadata: Caller information added to the checkpoint's metadata (for example the
                run's Hydra config under ``"config"``).

        Returns:
            The path of the checkpoint written.

        Raises:
            ModelNotReadyError: The model could not be loaded back as it is (never built, a
                layer whose config does not hold its attributes, ...): refused before anything
                is written.
            SaveError: ``path`` holds something that is not a trainer checkpoint, or the
                optimizer cannot be rebuilt.
            DiskFullError: The disk is full or a file-size limit was reached (a ``SaveError``).
            SavePermissionError: Writing there is not permitted (a ``SaveError``).
            LayerStateError: A layer's own ``save_own_variables`` or ``save_assets`` raised.
        """
        path = self.checkpoint_path(path)
        targets.check_replaceable(path, type(self))
        self.check_savable(model)
        state = state if state is not None else TrainingState()
        meta = self.build_metadata(model, state, metadata or {})
        try:
            with atomic_write(path, directory=self.is_directory) as tmp:
                known = self._write(model, tmp, state, meta)
                self.seal(tmp, known)  # the manifest: last, before the rename
        except (OSError, tf.errors.OpError) as error:  # disk full, permissions, I/O
            raise write_error(path, error) from error
        return path

    def write_into(
        self,
        model: keras.Model,
        directory: str | os.PathLike,
        *,
        state: TrainingState | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Write a checkpoint into a new directory that the caller publishes itself.

        For serving exports, which add files, seal and rename their own temporary. Not sealed:
        the caller calls ``seal`` when the directory is complete.

        Args:
            model: A built Keras model.
            directory: A directory that does not exist yet.
            state: The training state to record; a fresh one if omitted.
            metadata: Caller information added to the metadata.

        Raises:
            SaveError: This backend writes single files, not directories.
            ModelNotReadyError: The model could not be loaded back as it is.
            FileExistsError: ``directory`` exists already.
        """
        if not self.is_directory:
            raise SaveError(f"{self.name!r} writes files, not directories. Received {directory}")
        self.check_savable(model)
        state = state if state is not None else TrainingState()
        directory = local_path(directory, "directory")
        directory.mkdir()
        self._write(model, directory, state, self.build_metadata(model, state, metadata or {}))

    def load(
        self,
        path: str | os.PathLike,
        *,
        custom_objects: dict[str, Any] | None = None,
        compile: bool = True,
        safe_mode: bool = True,
        verify: bool = True,
        **options: Any,
    ) -> LoadedCheckpoint:
        """Read a checkpoint written by this backend.

        Every file is checked against the checkpoint's manifest (size and SHA-256) before its
        bytes reach the model. ``safe_mode`` is an argument of each load, never a state of the
        backend, so that concurrent loads of one instance cannot see each other's choice.

        Args:
            path: The checkpoint.
            custom_objects: Classes and functions by the name the checkpoint records.
            compile: Compile the model as it was compiled when saved.
            safe_mode: ``False`` lets the backend run Python code the checkpoint stores (a
                ``Lambda``'s bytecode), for a caller who trusts its source.
            verify: ``False`` checks sizes only, not digests, for a caller who accepts the risk.
            **options: Backend-specific (for example ``model``), passed on to ``_read``; a
                backend that takes none rejects them with a ``TypeError``.

        Returns:
            The ``LoadedCheckpoint`` (model compiled as saved, state, metadata, path).

        Raises:
            NotACheckpointError: ``path`` is not a complete checkpoint of this backend (the
                message names the backend that wrote it, if another did).
            IntegrityError: A file is missing, has another size or another digest.
            CorruptCheckpointError: The content is damaged or inconsistent in a way the
                manifest cannot tell (written so, or a checkpoint without one).
            IncompatibleFormatError: A newer format version than this backend reads.
            MissingClassError: A class the checkpoint needs is not available.
            RebuildError: A class is found but cannot rebuild from its saved config.
            UnsafeCheckpointError: It stores code and ``safe_mode`` is true.
        """
        path = local_path(path, "checkpoint path")
        targets.check_exists(path)
        if is_temporary(path) or not type(self).can_load(path):
            raise self._not_ours(path)
        register_serializables()  # the classes it may name, before anything is rebuilt
        custom_objects = custom_objects or {}
        signature = inspect.signature(self._read)
        options = load_refusals.read_options(self, signature, safe_mode, options)
        signature.bind(  # unknown options: TypeError, as documented
            path, custom_objects=custom_objects, compile=compile, **options
        )
        manifest, late = self.check_for_load(path, verify=verify)
        with integrity.pending(late):
            try:
                checkpoint = self._read_checked(path, custom_objects, compile, options)
            except BaseException:
                late.wait()  # damage explains any failure: its IntegrityError wins
                raise
            late.wait()  # before the model is handed out
        load_refusals.refuse_unsealed(path, manifest is not None, checkpoint.metadata)
        return checkpoint

    def _read_checked(
        self, path: Path, custom_objects: dict[str, Any], compile: bool, options: dict
    ) -> LoadedCheckpoint:
        """``_read`` within the size budget of the checkpoint, its raw errors made clear."""
        try:
            with limits.dimension_budget(integrity.total_size(path)):
                checkpoint = self._read(
                    path, custom_objects=custom_objects, compile=compile, **options
                )
            self.check_format_version(checkpoint.metadata, path)
        except TrainerError:
            raise
        except (
            load_refusals.DAMAGED_DATA_ERRORS
        ) as error:  # untrusted data: a clear error, not a raw one
            raise load_refusals.damaged(path, error) from error
        return checkpoint

    def check_savable(self, model: keras.Model) -> None:
        """Refuse, before anything is written, a model this backend could not load back.

        Args:
            model: The model about to be saved.

        Raises:
            ModelNotReadyError: Unbuilt, a ``__call__`` override that changes its inputs inside a
                Functional model, or what ``check_rebuildable`` refuses.
        """
        readiness.check_model_ready(model)
        readiness.refuse_reapplied_overrides(model)  # loads would compute something else
        config_check.check(model)  # state a rebuild from the config would lose
        vocabularies.refuse_unstorable_vocabularies(model)  # tokens the asset file loses
        readiness.refuse_unrecorded_policies(model)  # a policy the layer's config loses
        self.check_rebuildable(model)

    def check_rebuildable(self, model: keras.Model) -> None:
        """A backend that stores configs and weights rebuilds every layer from its config
        at load: refuse layers revived from traced functions (no class to rebuild), Keras
        layers whose own config fails to rebuild, and rebuilds that would lack weights or
        states. A backend that stores more (savedmodel: the traces) overrides this.

        Args:
            model: The model about to be saved.

        Raises:
            ModelNotReadyError: A layer this backend cannot rebuild, with the reason and
                the backend that can.
        """
        readiness.refuse_revived_layers(model, self.name)
        config_check.refuse_unrebuildable(model, self.name)  # Keras's own, that fail
        readiness.refuse_unbuildable_rebuild(model, self.name)  # no build, no states

    @classmethod
    @abc.abstractmethod
    def can_load(cls, path: Path) -> bool:
        """Whether ``path`` is a complete checkpoint of this backend (no model built).

        Args:
            path: A file or directory.

        Returns:
            True if this backend's ``load`` reads it.
        """

    @classmethod
    def read_metadata(cls, path: Path) -> dict[str, Any]:
        """The checkpoint's metadata without building the model.

        Backends override this with a cheap reader; the fallback loads the checkpoint.

        Args:
            path: A checkpoint of this backend.

        Returns:
            Its metadata, with the training state under ``"state"``.

        Raises:
            CorruptCheckpointError: The metadata cannot be read or has the wrong types.
            NotACheckpointError: ``path`` is not a checkpoint of this backend.
        """
        return cls().load(path, compile=False).metadata

    def checkpoint_path(self, path: str | os.PathLike) -> Path:
        """The final path a checkpoint at ``path`` gets (adds the file suffix if missing)."""
        path = local_path(path, "checkpoint path")
        if self.suffix and not path.name.endswith(self.suffix):
            path = path.with_name(path.name + self.suffix)
        return path

    # ------------------------------------------------------------- write lifecycle
    # What a caller of many saves (``CheckpointManager``) asks of any backend, wrappers
    # included, so that it needs to know none of them: here, for a backend that writes in
    # the caller's thread, there is nothing to prepare and nothing to wait for.
    def prepare(self, model: keras.Model) -> None:
        """Training of ``model`` starts: a backend may pay its one-time work of the first
        saves now (the async wrapper builds its copy of the model). Nothing here.

        Args:
            model: The model about to train.
        """

    def submit(self, model: keras.Model, job: Callable[[SaveBackend, keras.Model], Any]) -> None:
        """Run ``job(writer, model)``: one save, written by ``writer`` (a backend's
        ``save``) from the model it is given. Here ``job(self, model)``, at once, in the
        caller's thread; the async wrapper runs it later in its writer thread, with the
        backend it wraps and a copy of ``model`` taken now.

        Args:
            model: The model to save.
            job: The save: called with the backend that writes it and the model to write.
        """
        job(self, model)

    def wait(self) -> None:
        """Return once every write handed to this backend is on disk.

        A backend that writes in the caller's thread has none pending.

        Raises:
            SaveError: A background write failed (the previous checkpoints are intact).
        """

    def close(self) -> None:
        """No more saves: finish the pending writes (``wait``)."""
        self.wait()

    # -------------------------------------------------------------- metadata hooks
    def build_metadata(
        self, model: keras.Model, state: TrainingState, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """Metadata common to every backend; subclasses may extend it."""
        meta = {
            "format": "trainer-checkpoint",
            "backend": self.name,
            "backend_class": class_path(type(self)),
            "format_version": self.format_version,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "trainer_version": __version__,
            "keras_version": keras.__version__,
            "tensorflow_version": tf.__version__,
            "model_class": type(model).__name__,
            "model_name": model.name,
            "num_params": int(model.count_params()),
            "state": state.to_dict(),
        }
        record = self.integrity_record()
        if record is not None:
            meta["integrity"] = record
        meta.update(extra)
        return meta

    def check_format_version(self, metadata: dict[str, Any], path: Path) -> None:
        """Format versions are major versions: newer ones are refused, older ones down to
        ``min_format_version`` load.

        Args:
            metadata: The checkpoint's stored metadata.
            path: The checkpoint, named in the errors.

        Raises:
            CorruptCheckpointError: The metadata is no JSON object or its
                ``format_version`` no integer.
            IncompatibleFormatError: A version newer than this trainer reads, or older
                than ``min_format_version``.
        """
        load_refusals.check_format_version(
            metadata,
            path,
            backend=self.name,
            newest=self.format_version,
            oldest=self.min_format_version,
        )

    def _not_ours(self, path: Path) -> TrainerError:
        """Why ``path`` is not ours: another backend's, damaged (its manifest says which
        file), or nothing trainer knows."""
        return load_refusals.not_ours(path, self.name)

    # ------------------------------------------------------------ implementation
    @abc.abstractmethod
    def _write(
        self, model: keras.Model, tmp: Path, state: TrainingState, metadata: dict[str, Any]
    ) -> integrity.Known | None:
        """Write everything into ``tmp`` (a fresh directory, or a file path to create).

        May return the size and SHA-256 of files it wrote from memory, by path relative to
        ``tmp`` (``integrity.known_digest``), or hashed in a thread while it wrote the rest
        (``integrity.PendingDigest``), which the manifest then takes instead of reading
        those files back."""

    @abc.abstractmethod
    def _read(
        self, path: Path, *, custom_objects: dict[str, Any], compile: bool, safe_mode: bool
    ) -> LoadedCheckpoint:
        """Rebuild the model and state from a complete checkpoint at ``path``; code the
        checkpoint stores may run only when ``safe_mode`` is False."""


# Kept importable from here, where it was defined first.
DAMAGED_DATA_ERRORS = load_refusals.DAMAGED_DATA_ERRORS

# Kept importable from here, where it was defined first.
class_path = naming.class_path
