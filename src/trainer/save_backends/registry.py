"""Name -> backend class registry, with lazy imports so naming a backend costs nothing.

Built-in backends are registered by import path; users add theirs with
``register_backend``, third-party distributions through the entry-point group
``trainer.save_backends`` (``npz = mypkg.backends:NpzBackend``), or bypass the registry with
a Hydra ``_target_``. A checkpoint written through ``_target_`` is loadable only once its
backend is registered one of these ways, or by a caller that names the backend class itself
(``configured=``: a run resuming with its own config): loading never imports a class a
checkpoint names. Here too: which backend wrote a path (``detect_backend``); reading it
(leases, replaced links, object storage) is ``loading``'s.
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
from trainer.save_backends.base import SaveBackend, class_path
from trainer.storage import integrity
from trainer.storage.locations import local_path
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
