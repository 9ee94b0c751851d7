"""Name -> backend class registry, with lazy imports so naming a backend costs nothing.

Built-in backends are registered by import path; users add theirs with
``register_backend``, third-party distributions through the entry-point group
``trainer.save_backends`` (``npz = mypkg.backends:NpzBackend``), or bypass the registry with
a Hydra ``_target_``. A checkpoint written through ``_target_`` is loadable only once its
backend is registered one of these ways, or by a caller that names the backend class itself
(``configured=``: a run resuming with its own config): loading never imports a class a
checkpoint names.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import types
from pathlib import Path
from typing import Any

from trainer.errors import (
    BackendUnavailableError,
    NotACheckpointError,
    TrainerError,
    UnknownBackendError,
)
from trainer.save_backends import hints
from trainer.save_backends.base import LoadedCheckpoint, SaveBackend, class_path
from trainer.storage import integrity
from trainer.storage.arrival import Arrival, arriving
from trainer.storage.locations import is_remote, local_path
from trainer.storage.locks import read_lease
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.targets import check_exists, set_format_detector

_BUILTIN = {
    "savedmodel": "trainer.save_backends.savedmodel:SavedModelBackend",
    "h5": "trainer.save_backends.h5:H5Backend",
    "weights": "trainer.save_backends.weights:WeightsBackend",
}
ENTRY_POINT_GROUP = "trainer.save_backends"
_registry: dict[str, str | type[SaveBackend]] = dict(_BUILTIN)
_origins: dict[str, str] = {}  # name -> the entry point that registered it
_entry_points_read = False
log = logging.getLogger(__name__)


def _read_entry_points() -> None:
    """Register the backends installed distributions declare in ``ENTRY_POINT_GROUP``, once,
    on the first lookup: only their ``"module:Class"`` is recorded, nothing is imported
    until a backend is used. Built-in names and names registered in code before win."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    try:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as error:  # one broken installed distribution must not break loading
        log.warning("Could not read the %s entry points: %r", ENTRY_POINT_GROUP, error)
        return
    for entry in found:
        dist = getattr(entry.dist, "name", None) or "an unnamed distribution"
        origin = f"entry point {entry.name} = {entry.value} of {dist}"
        if entry.name in _registry:
            log.warning("Ignored the save backend %s: %r is already registered", origin, entry.name)
            continue
        _registry[entry.name] = entry.value.split("[")[0].strip()  # extras mean nothing here
        _origins[entry.name] = origin


def register_backend(
    name: str, backend: str | type[SaveBackend], *, overwrite: bool = False
) -> None:
    """Register a save backend under a name, for ``get_backend`` and format detection.

    Names registered in code win over entry points of the same name; the built-in backends
    are registered this way.

    Args:
        name: The name to select it by (``get_backend(name)``, ``python -m trainer`` commands).
        backend: The ``SaveBackend`` subclass, or ``"module:Class"`` to import it only when a
            checkpoint of its format is read or the name is asked for.
        overwrite: Replace a backend already registered under ``name``.

    Raises:
        ValueError: ``name`` is already registered and ``overwrite`` is false.
    """
    _read_entry_points()
    if name in _registry and not overwrite:
        raise ValueError(
            f"A save backend named {name!r} is already registered; pass overwrite=True to "
            f"replace it. Received name={name!r}"
        )
    _registry[name] = backend


def available_backends() -> types.MappingProxyType:
    """Every registered backend name and its target, without importing any.

    Returns:
        A read-only mapping of name to class or ``"module:Class"`` path, entry points of
        installed distributions (group ``trainer.save_backends``) included.
    """
    _read_entry_points()
    return types.MappingProxyType(_registry)


def backend_class(name: str) -> type[SaveBackend]:
    """The class registered under a name, imported now if it was registered by path.

    Args:
        name: A registered backend name (``available_backends()``).

    Returns:
        The ``SaveBackend`` subclass.

    Raises:
        UnknownBackendError: No backend is registered under ``name``; the message lists the
            valid names (also a ``KeyError``).
        BackendUnavailableError: The registered target cannot be imported or is not a
            ``SaveBackend`` subclass (also an ``ImportError``).
    """
    _read_entry_points()
    try:
        target = _registry[name]
    except (KeyError, TypeError):
        raise UnknownBackendError(
            f"Unknown save backend {name!r}. Valid names: {', '.join(sorted(_registry))}. "
            f"{HOW_TO_REGISTER} Received: {name!r}"
        ) from None
    if isinstance(target, str):
        target = _import_backend(name, target)
        _registry[name] = target
    return target


HOW_TO_REGISTER = (
    "Register a backend with trainer.save_backends.register_backend(name, 'module:Class'), "
    f"or declare it in its distribution as an entry point of group {ENTRY_POINT_GROUP!r} "
    "(name = module:Class), or select it for training with save._target_ in the config."
)


def _import_backend(name: str, target: str) -> type[SaveBackend]:
    """Import ``"module:Class"``; any failure is a ``BackendUnavailableError`` (also an
    ``ImportError``), so that detection skips that backend and names it."""
    origin = _origins.get(name, "registered in code")
    module_name, _, attr = target.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in filter(None, attr.split(".")):
            found = getattr(found, part)
    except Exception as error:  # a third-party module may fail in any way while importing
        raise BackendUnavailableError(
            f"Save backend {name!r} ({origin}) cannot be imported: {type(error).__name__}: "
            f"{error}. Install the package that provides {module_name!r} or fix the "
            f"registration. Valid names: {', '.join(sorted(_registry))}. Received: {target!r}"
        ) from error
    if not (isinstance(found, type) and issubclass(found, SaveBackend)):
        raise BackendUnavailableError(
            f"Save backend {name!r} ({origin}) names {target!r}, which is not a subclass of "
            f"trainer.save_backends.SaveBackend; point it at a 'module:Class' backend class. "
            f"Valid names: {', '.join(sorted(_registry))}. Received: {found!r}"
        )
    return found


def get_backend(name: str, **options: Any) -> SaveBackend:
    """An instance of the backend registered under a name.

    Args:
        name: A registered backend name: ``"savedmodel"``, ``"h5"``, ``"weights"`` or one of
            yours.
        **options: Passed to the backend's constructor.

    Returns:
        The backend, ready to ``save`` and ``load``.

    Raises:
        UnknownBackendError: No backend is registered under ``name``.
        BackendUnavailableError: Its class cannot be imported.
    """
    return backend_class(name)(**options)


def detect_backend(
    path: str | os.PathLike, *, configured: type[SaveBackend] | None = None
) -> type[SaveBackend]:
    """The backend whose format a checkpoint is in.

    Every registered backend is asked in turn (``SaveBackend.can_load``); one whose module
    cannot be imported is skipped and named if nothing claims the path.

    Args:
        path: A checkpoint (a directory or a file).
        configured: The backend class a run's own config selected (``save._target_``: code
            the user chose, so using it runs nothing a file names); a run resuming its own
            checkpoints reads them with it even when it is not registered.

    Returns:
        The ``SaveBackend`` subclass that reads ``path``.

    Raises:
        UnsupportedLocationError: ``path`` is a URL (``s3://...``), not a local path.
        NotACheckpointError: Nothing is at ``path``, no backend claims it (the message says
            what it is instead: a run directory, a ``.keras`` file...), or an unregistered
            backend wrote it (the message gives the ``register_backend`` call).
        IntegrityError: It is a damaged trainer checkpoint; the message names the file.
    """
    path = local_path(path, "checkpoint path")
    check_exists(path)
    _read_entry_points()
    unavailable = []
    for name in list(_registry):
        try:
            cls = backend_class(name)
        except ImportError as error:
            # A backend whose module is missing cannot claim the path; the others still can.
            unavailable.append(f"{name} ({error})")
            continue
        if cls.can_load(path):
            return cls
    if configured is not None and configured.can_load(path):
        return configured
    _refuse_unregistered(path)
    integrity.diagnose(path)  # a damaged checkpoint of ours: name the bad file
    skipped = ""
    if unavailable:
        skipped = f" Backends that could not be imported: {'; '.join(unavailable)}."
    advice = hints.advice(path, _is_checkpoint)
    if advice == hints.GENERIC:  # what the path is, nothing here can tell
        advice += f" If a third-party backend (save._target_) wrote it: {HOW_TO_REGISTER}"
    raise NotACheckpointError(
        f"{path} is not a checkpoint in any registered format "
        f"({', '.join(sorted(_registry))}).{skipped} {advice} Received: {str(path)!r}"
    )


def _refuse_unregistered(path: Path) -> None:
    """Name the backend a checkpoint records (its manifest: directory checkpoints) when
    that backend is not registered, and say how to register it. The recorded class is
    never imported: that would run code a file names. A recorded backend that is
    registered was tried above; ``integrity.diagnose`` then says what is damaged."""
    try:
        found = integrity.find_manifest(path)
    except TrainerError:
        return  # a damaged manifest: diagnose names it
    if found is None or not isinstance(found[1].get("backend"), str):
        return
    name, recorded = found[1]["backend"], found[1].get("backend_class")
    registered = {t if isinstance(t, str) else class_path(t) for t in _registry.values()}
    if name in _registry or recorded in registered:
        return
    example = recorded if isinstance(recorded, str) else "module:Class"
    raise NotACheckpointError(
        f"{path} was written by the save backend {name!r} ({example}), which is not "
        f"registered in this process, so it cannot be read; trainer never imports a class "
        f"named by a checkpoint. Register it before loading: register_backend({name!r}, "
        f"{example!r}), or an entry point `{name} = {example}` in group "
        f"{ENTRY_POINT_GROUP!r} of the distribution that provides it. Registered: "
        f"{', '.join(sorted(_registry))}. Received: backend {name!r}"
    )


def _is_checkpoint(path: Path) -> bool:
    """Whether a registered (importable) backend claims ``path``; for the hints only."""
    for name in list(_registry):
        try:
            if backend_class(name).can_load(path):
                return True
        except ImportError:
            continue
    return False


set_format_detector(detect_backend)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    custom_objects: dict[str, Any] | None = None,
    compile: bool = True,
    safe_mode: bool = True,
    verify: bool = True,
    configured: type[SaveBackend] | None = None,
    **options: Any,
) -> LoadedCheckpoint:
    """Load a checkpoint of any backend, detecting its format.

    Safe while a trainer writes next to it: a symlink such as ``checkpoints/latest`` is
    resolved once and the checkpoint it names is leased for the read, so retention leaves
    it alone (``trainer.storage.locks``); if it was replaced, or removed before the lease was
    taken, the read starts over from where the link points now.

    ``path`` may be a URL on object storage (``s3://bucket/run/checkpoints/<name>``, or
    ``.../checkpoints/latest``): the complete checkpoint it names (its commit marker) is
    downloaded into the local cache, checked against the marker, then read from there
    like a local one (``LoadedCheckpoint.path`` is that local copy).

    Args:
        path: A checkpoint, or a link to one (``<run>/checkpoints/latest``); a local
            path or an ``s3://`` URL.
        custom_objects: Classes and functions by the name the checkpoint records, for custom
            classes that were not registered when saved.
        compile: Compile the model as it was compiled when saved.
        safe_mode: ``False`` runs code the checkpoint stores (a ``Lambda``'s bytecode), for a
            caller who trusts its source.
        verify: Check every file's SHA-256 against the manifest (the default); ``False``
            checks sizes only.
        configured: See ``detect_backend``.
        **options: Backend-specific options of ``SaveBackend.load``.

    Returns:
        The ``LoadedCheckpoint``: ``model``, ``state``, ``metadata`` and ``path`` (the
        checkpoint actually read).

    Raises:
        NotACheckpointError: ``path`` is not a checkpoint of a registered backend, or kept
            changing while it was read.
        IntegrityError: A file does not match the manifest (size or digest), or the
            manifest is missing.
        CorruptCheckpointError: The content is damaged or out of bounds.
        IncompatibleFormatError: A newer format version than this trainer reads.
        MissingClassError: A custom class it needs is neither registered nor in
            ``custom_objects`` (h5, weights; savedmodel revives it from its traces).
        RebuildError: A class is found but cannot rebuild from its saved config.
        UnsafeCheckpointError: It holds code (a ``Lambda``) and ``safe_mode`` is true (h5,
            weights; savedmodel revives it from its traces).
        UnsupportedLocationError: ``path`` is a URL of a scheme trainer cannot use.
        StoreError: The object store cannot be reached or refuses the request (missing
            bucket, wrong credentials, unreachable endpoint).
    """
    kwargs = dict(
        custom_objects=custom_objects, compile=compile, safe_mode=safe_mode, verify=verify
    )
    if not is_remote(path):
        return _load_local(local_path(path, "checkpoint path"), kwargs, options, configured)
    # The large late-read files may still be downloading while the model is rebuilt from
    # the small ones (``trainer.storage.arrival``); the load's digest check waits for them.
    path, arrival = _fetch_for_load(path, configured if verify else None, overlap=verify)
    with arriving(arrival):
        try:
            checkpoint = _load_local(path, kwargs, options, configured)
        except BaseException:
            if arrival is not None:
                arrival.wait()  # a damaged or failed download explains the failure
            raise
    if arrival is not None:
        arrival.wait()
    return checkpoint


def _load_local(
    path: Path,
    kwargs: dict[str, Any],
    options: dict[str, Any],
    configured: type[SaveBackend] | None,
) -> LoadedCheckpoint:
    """``load_checkpoint`` of a local path: leased, read again if it was replaced."""
    for attempt in range(_ATTEMPTS):
        target = _resolve(path)
        # The lease keeps retention from deleting it; taken before the identity check, so
        # a deletion that started first shows as "moved" (see trainer.storage.locks).
        with read_lease(target):
            before = _identity(target)
            try:
                if before is None:
                    check_exists(target)  # removed between the link and the lease
                backend = detect_backend(target, configured=configured)
                checkpoint = backend().load(target, **kwargs, **options)
            except (TrainerError, OSError):
                if attempt + 1 < _ATTEMPTS and _moved(path, target, before):
                    log.info("%s changed while it was read; reading it again", path)
                    continue  # the writer replaced what we were reading: read the new one
                raise
            now = _identity(target)
        if now is None or now == before:  # gone after a complete read is fine; not swapped
            return checkpoint
        log.info("%s was replaced while it was read; reading it again", path)
    raise NotACheckpointError(
        f"{path} changed {_ATTEMPTS} times while it was being read; a writer is replacing "
        f"it faster than it can be loaded. Load a specific checkpoint instead of a link. "
        f"Received: {str(path)!r}"
    )


_ATTEMPTS = 8


def _resolve(path: Path) -> Path:
    if not path.is_symlink():
        return path
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link or a loop
        check_exists(path)
        raise


def _identity(path: Path) -> tuple[int, int] | None:
    """Published checkpoints are never modified in place, only replaced (a new inode) or
    removed, so device and inode tell whether ``path`` still holds what was read."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _moved(path: Path, target: Path, before: tuple[int, int] | None) -> bool:
    """Whether ``path`` now names something other than what the read started from."""
    try:
        now = _resolve(path)
    except (OSError, RuntimeError, TrainerError):
        return True
    return now != target or _identity(target) != before


def fetch_remote(url: str) -> Path:
    """The local cached copy of the checkpoint ``url`` names (``<dir URL>/<name>``)."""
    directory, _, name = os.fspath(url).rstrip("/").rpartition("/")
    if directory.endswith(":/"):  # s3://bucket: a bucket is no checkpoint
        raise NotACheckpointError(
            f"{url} names a bucket, not a checkpoint: give <directory URL>/<name> or "
            f"<directory URL>/latest. Received: {os.fspath(url)!r}"
        )
    return RemoteCheckpoints(directory).fetch(name)


def _fetch_for_load(
    url: str, configured: type[SaveBackend] | None, *, overlap: bool
) -> tuple[Path, Arrival | None]:
    """``fetch_remote`` for a load: with ``overlap``, the backend's late-read files may
    still arrive (the ``Arrival``) when this returns."""
    directory, _, name = os.fspath(url).rstrip("/").rpartition("/")
    if directory.endswith(":/") or not overlap:
        return fetch_remote(url), None

    def late(partial: Path) -> tuple[str, ...]:
        """The patterns of the files the backend of ``partial`` (every object but the
        large ones downloaded) reads only after ``integrity.await_digests``; () if no
        backend claims it yet, or it does not check a manifest's digests in a thread."""
        try:
            backend = detect_backend(partial, configured=configured)
        except (TrainerError, OSError):  # the load of the whole checkpoint will say why
            return ()
        manifest = backend.manifest_file
        if not (backend.is_directory and manifest and (partial / manifest).is_file()):
            return ()
        return tuple(backend.read_late)

    return RemoteCheckpoints(directory).fetch_for_load(name, late)


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a checkpoint, without building its model.

    Args:
        path: A checkpoint of any registered backend (a local path or an ``s3://`` URL).

    Returns:
        Its metadata: backend, format version, versions, the run's config, and the training
        state under ``"state"``.

    Raises:
        NotACheckpointError: ``path`` is not a checkpoint of a registered backend.
        CorruptCheckpointError: Its metadata cannot be read or has the wrong types.
        IncompatibleFormatError: A newer format version than this trainer reads.
    """
    path = fetch_remote(path) if is_remote(path) else local_path(path, "checkpoint path")
    return detect_backend(path).read_metadata(path)
