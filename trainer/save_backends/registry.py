"""Name -> backend class registry, with lazy imports so naming a backend costs nothing.

Built-in backends are registered by import path; users add theirs with
``register_backend`` or bypass the registry entirely with a Hydra ``_target_``.
"""

from __future__ import annotations

import importlib
import logging
import os
import types
from pathlib import Path
from typing import Any

from trainer import integrity
from trainer.errors import NotACheckpointError, TrainerError, UnknownBackendError
from trainer.locks import read_lease
from trainer.save_backends import hints
from trainer.save_backends.base import Checkpoint, SaveBackend, check_exists, set_format_detector

_BUILTIN = {
    "savedmodel": "trainer.save_backends.savedmodel:SavedModelBackend",
    "h5": "trainer.save_backends.h5:H5Backend",
    "weights": "trainer.save_backends.weights:WeightsBackend",
}
_registry: dict[str, str | type[SaveBackend]] = dict(_BUILTIN)
log = logging.getLogger(__name__)


def register_backend(name: str, backend: str | type[SaveBackend], *, overwrite=False) -> None:
    """Register ``backend`` (a class or a ``"module:Class"`` string) under ``name``."""
    if name in _registry and not overwrite:
        raise ValueError(
            f"A save backend named {name!r} is already registered; pass overwrite=True to "
            f"replace it. Received name={name!r}"
        )
    _registry[name] = backend


def available_backends() -> types.MappingProxyType:
    """Read-only view of registered names and their targets (classes or import paths)."""
    return types.MappingProxyType(_registry)


def backend_class(name: str) -> type[SaveBackend]:
    try:
        target = _registry[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(_registry))
        raise UnknownBackendError(
            f"Unknown save backend {name!r}. Valid names: {valid}. Register your own with "
            f"trainer.save_backends.register_backend or use save._target_ in the config. "
            f"Received: {name!r}"
        ) from None
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module_name), attr)
        _registry[name] = target
    return target


def get_backend(name: str, **options: Any) -> SaveBackend:
    """Instantiate the backend registered under ``name`` with ``options``."""
    return backend_class(name)(**options)


def detect_backend(path: str | os.PathLike) -> type[SaveBackend]:
    """The registered backend whose format ``path`` is in."""
    path = Path(path)
    check_exists(path)
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
    integrity.diagnose(path)  # a damaged checkpoint of ours: name the bad file
    skipped = ""
    if unavailable:
        skipped = f" Backends that could not be imported: {'; '.join(unavailable)}."
    raise NotACheckpointError(
        f"{path} is not a checkpoint in any registered format "
        f"({', '.join(sorted(_registry))}).{skipped} {hints.advice(path, _is_checkpoint)} "
        f"Received: {str(path)!r}"
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


def load_checkpoint(path: str | os.PathLike, **kwargs: Any) -> Checkpoint:
    """Detect the format of ``path`` and load it with the matching backend.

    Safe while a trainer writes next to it: a symlink such as ``checkpoints/latest`` is
    resolved once and the checkpoint it names is leased for the read, so retention leaves
    it alone (``trainer.locks``); if it was replaced, or removed before the lease was
    taken, the read starts over from where the link points now. The returned
    ``Checkpoint.path`` is the checkpoint actually read.
    """
    path = Path(path)
    for attempt in range(_ATTEMPTS):
        target = _resolve(path)
        # The lease keeps retention from deleting it; taken before the identity check, so
        # a deletion that started first shows as "moved" (see trainer.locks).
        with read_lease(target):
            before = _identity(target)
            try:
                if before is None:
                    check_exists(target)  # removed between the link and the lease
                checkpoint = detect_backend(target)().load(target, **kwargs)
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


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Metadata (with the training state) of the checkpoint at ``path``, model not built."""
    return detect_backend(path).read_metadata(Path(path))
