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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import keras
import tensorflow as tf
from google.protobuf.message import DecodeError

from trainer.errors import (
    CorruptCheckpointError,
    IncompatibleFormatError,
    IntegrityError,
    NotACheckpointError,
    SaveError,
    TrainerError,
)
from trainer.model_state import config_check, readiness, vocabularies
from trainer.model_state.serializables import register_serializables
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


class SaveBackend(abc.ABC):
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
    # Manifest location inside a directory checkpoint (``trainer.storage.integrity``); None: none.
    manifest_file: ClassVar[str | None] = integrity.MANIFEST_FILE
    is_directory: ClassVar[bool] = True
    suffix: ClassVar[str] = ""
    # Whether the checkpoint callback writes in a background thread unless told otherwise.
    async_by_default: ClassVar[bool] = False
    # Files (``fnmatch`` patterns, relative to a directory checkpoint) that ``_read`` reads
    # only after calling ``integrity.await_digests()``: their digests are checked in a
    # thread while it rebuilds the model from the rest. Any other file is checked first.
    read_late: ClassVar[tuple[str, ...]] = ()
    # Whether ``save`` may return before the checkpoint is written (``wait`` finishes it):
    # the async wrapper (``trainer.checkpointing.AsyncBackend``); a backend never does.
    writes_in_background: ClassVar[bool] = False

    def __repr__(self) -> str:
        """``H5Backend()``, ``H5Backend(compression='gzip')``: the class and the constructor
        arguments that differ from their defaults (read from the attributes of the same
        name). The start-of-training log line shows the backend, wrappers included
        (``AsyncBackend(SavedModelBackend())``); object's default was an address."""
        try:
            parameters = inspect.signature(type(self).__init__).parameters.values()
        except (TypeError, ValueError):  # a C-level or otherwise unreadable constructor
            parameters = ()
        shown = []
        for parameter in parameters:
            if parameter.name == "self" or parameter.kind in _VARIADIC:
                continue
            if parameter.name not in vars(self):  # not kept under its own name: not shown
                continue
            value = vars(self)[parameter.name]
            if not _is_default(value, parameter.default):
                shown.append(f"{parameter.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

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
        options = self._read_options(signature, safe_mode, options)
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
        self._refuse_unsealed(path, manifest is not None, checkpoint.metadata)
        return checkpoint

    def _read_options(
        self, signature: inspect.Signature, safe_mode: bool, options: dict[str, Any]
    ) -> dict[str, Any]:
        """The keyword arguments ``_read`` gets besides ``custom_objects`` and ``compile``.

        ``safe_mode`` is part of the ``_read`` contract. A ``_read`` written before it was
        (no ``safe_mode`` parameter) is called without it for one more release, with a
        DeprecationWarning: such a backend has no way to run stored code to allow."""
        parameters = signature.parameters
        if "safe_mode" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            return {"safe_mode": safe_mode, **options}
        warnings.warn(
            f"{type(self).__qualname__}._read takes no safe_mode argument; declare "
            f"`safe_mode: bool` (True: never run code a checkpoint stores). Trainer will pass "
            f"it to every backend's _read from the next release on.",
            DeprecationWarning,
            stacklevel=3,
        )
        return dict(options)

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
        except DAMAGED_DATA_ERRORS as error:  # untrusted data: a clear error, not a raw one
            raise CorruptCheckpointError(
                f"{path} could not be loaded: its content is damaged or inconsistent "
                f"({type(error).__name__} while rebuilding it). Run `python -m trainer "
                f"verify {path}`, or load an older checkpoint. Received error: "
                f"{type(error).__name__}: {str(error)[:500]}"
            ) from error
        return checkpoint

    def _refuse_unsealed(self, path: Path, sealed: bool, metadata: dict[str, Any]) -> None:
        """A checkpoint whose metadata says it was sealed must still have its manifest."""
        record = metadata.get("integrity")
        if not sealed and record:
            where = record.get("manifest") if isinstance(record, dict) else record
            raise IntegrityError(
                f"{path}: the manifest of its files ({where!r}) is missing, although the "
                f"checkpoint was written with one; files may have been removed or replaced. "
                f"Restore it from a copy or load an older checkpoint. Received: no manifest",
                path=path,
                file=str(where),
            )

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
    def prepare(self, model: keras.Model) -> None:  # noqa: B027  (a no-op by design)
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

    def wait(self) -> None:  # noqa: B027  (a no-op by design)
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
        if not isinstance(metadata, dict):
            raise CorruptCheckpointError(
                f"{path}: the stored metadata must be a JSON object; the checkpoint is "
                f"damaged. Load an older checkpoint. Received {type(metadata).__name__}"
            )
        version = metadata.get("format_version")
        if type(version) is not int:
            raise CorruptCheckpointError(
                f"{path}: the stored format_version must be an integer; the checkpoint is "
                f"damaged. Load an older checkpoint. Received format_version={version!r}"
            )
        if version > self.format_version:
            raise IncompatibleFormatError(
                f"{path} was written in {self.name!r} format version {version!r}, but this "
                f"trainer reads versions up to {self.format_version}. Upgrade trainer to load "
                f"it. Received format_version={version!r}"
            )
        if version < self.min_format_version:
            raise IncompatibleFormatError(
                f"{path} was written in {self.name!r} format version {version}, which this "
                f"trainer no longer reads (oldest supported: {self.min_format_version}). "
                f"Load it with an older trainer and save it again. "
                f"Received format_version={version}"
            )

    # ----------------------------------------------------------------- integrity
    def integrity_record(self) -> dict[str, Any] | None:
        """Where this backend keeps its manifest; stored in the metadata so that a
        checkpoint whose manifest was removed is detected.

        Returns:
            The manifest's file name and digest algorithm, or None: no manifest.
        """
        if not (self.is_directory and self.manifest_file):
            return None
        return {"manifest": self.manifest_file, "algorithm": integrity.ALGORITHM}

    def seal(self, tmp: Path, known: integrity.Known | None = None) -> None:
        """Write the manifest of a finished directory checkpoint, before its rename.

        Args:
            tmp: The temporary directory the checkpoint was written into.
            known: What ``_write`` returned: sizes and digests it need not read back.
        """
        if self.is_directory and self.manifest_file:
            integrity.write_manifest(
                tmp,
                self.manifest_file,
                known,
                backend=self.name,
                backend_class=class_path(type(self)),  # named in errors, never imported
                format_version=self.format_version,
            )

    def check_for_load(
        self, path: Path, *, verify: bool
    ) -> tuple[dict[str, Any] | None, integrity.DigestCheck]:
        """What ``load`` checks before ``_read``.

        Args:
            path: The checkpoint.
            verify: Check digests too, not only sizes.

        Returns:
            The manifest (None: the checkpoint has none) and the check of the digests of
            the ``read_late`` files, still being computed while the load reads them.

        Raises:
            IntegrityError: A file is missing, of another size or (``verify``) digest.
        """
        if verify and self.is_directory and self.manifest_file:
            return integrity.check_for_load(path, self.manifest_file, self.read_late)
        return self.check_integrity(path, digests=verify), integrity.NOTHING_PENDING

    def check_integrity(
        self, path: Path, *, digests: bool, strict: bool = False
    ) -> dict[str, Any] | None:
        """Check files against the manifest (sizes; digests and unlisted files on request).

        Single-file backends that embed a manifest override this.

        Args:
            path: The checkpoint.
            digests: Check SHA-256 digests too.
            strict: Also refuse files the manifest does not list.

        Returns:
            The manifest, or None if the checkpoint has none.

        Raises:
            IntegrityError: A file is missing, of another size or digest, or unlisted
                (``strict``).
        """
        if self.is_directory and self.manifest_file:
            return integrity.verify_directory(
                path, self.manifest_file, digests=digests, strict=strict
            )
        return None

    def _not_ours(self, path: Path) -> TrainerError:
        """Why ``path`` is not ours: another backend's, damaged (its manifest says which
        file), or nothing trainer knows."""
        if is_temporary(path):
            actual = "it is the temporary of a save in progress or of a crashed one"
        elif targets.format_detector() is None:
            actual = "no backend registry was imported to tell what it is"
        else:
            try:
                actual = f"it is a {targets.format_detector()(path).name!r} checkpoint"
            except CorruptCheckpointError as error:
                return error
            except TrainerError as error:
                actual = f"no backend recognises it ({str(error).split('. ')[0]})"
        return NotACheckpointError(
            f"{path} is not a complete {self.name!r} checkpoint: {actual}. Load it with "
            f"`trainer.save_backends.load_checkpoint`, which detects the format. "
            f"Received: {str(path)!r}"
        )

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


# What reading damaged or inconsistent stored data raises inside Keras, TensorFlow, h5py,
# protobuf and json: turned into CorruptCheckpointError at the load boundary. Anything
# else (AttributeError, NameError, AssertionError...) is a bug in trainer and surfaces as
# itself, instead of blaming the checkpoint.
DAMAGED_DATA_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # includes json's JSONDecodeError and UnicodeDecodeError
    TypeError,
    LookupError,  # KeyError, IndexError
    OSError,  # includes h5py's read errors
    EOFError,
    # h5py's errors for damaged HDF5 structures ("bad local heap signature", "link
    # iteration failed"), met when a load skips digests (verify=False, unsealed files);
    # RecursionError too.
    RuntimeError,
    tf.errors.OpError,
    DecodeError,
)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _is_default(value: Any, default: Any) -> bool:
    """Whether a constructor argument kept as ``value`` is its ``default`` (an argument
    without a default, or one whose ``==`` does not give a bool, is shown)."""
    if default is inspect.Parameter.empty:
        return False
    try:
        return bool(value is default or value == default)
    except Exception:  # e.g. an array's ambiguous truth value
        return False


def class_path(cls: type) -> str:
    """``"module:Qualified.Name"``: how ``register_backend`` and entry points name a class."""
    return f"{cls.__module__}:{cls.__qualname__}"
