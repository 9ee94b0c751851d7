"""Loading any checkpoint by its path: local or on object storage, leased while it is read,
read again if a writer replaced it meanwhile.

Split from ``registry`` (which names the backends and tells which one wrote a path): a
load also deals with links replaced under it, retention's leases and downloads from a
store, none of which is about naming backends. The package exports ``load_checkpoint``
and ``read_checkpoint_metadata``; ``fetch_remote`` is for the commands that read a
checkpoint on a store (``trainer inspect``, ``verify``, ``export``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trainer.errors import NotACheckpointError, TrainerError
from trainer.save_backends.base import LoadedCheckpoint, SaveBackend
from trainer.save_backends.registry import detect_backend
from trainer.storage.arrival import Arrival, arriving
from trainer.storage.locations import is_remote, local_path
from trainer.storage.locks import read_lease
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.targets import check_exists

log = logging.getLogger(__name__)
_ATTEMPTS = 8  # reads of a path a writer keeps replacing, before giving up


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
