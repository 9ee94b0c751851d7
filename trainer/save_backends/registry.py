"""Name -> backend class registry, with lazy imports so naming a backend costs nothing.

Built-in backends are registered by import path; users add theirs with
``register_backend`` or bypass the registry entirely with a Hydra ``_target_``.
"""

from __future__ import annotations

import importlib
import os
import types
from pathlib import Path
from typing import Any

from trainer.errors import NotACheckpointError, UnknownBackendError
from trainer.save_backends.base import Checkpoint, SaveBackend

_BUILTIN = {
    "savedmodel": "trainer.save_backends.savedmodel:SavedModelBackend",
    "h5": "trainer.save_backends.h5:H5Backend",
    "weights": "trainer.save_backends.weights:WeightsBackend",
}
_registry: dict[str, str | type[SaveBackend]] = dict(_BUILTIN)


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
    if not path.exists():
        raise NotACheckpointError(
            f"No checkpoint at {path}: the path does not exist. Check the path. "
            f"Received: {str(path)!r}"
        )
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
    skipped = ""
    if unavailable:
        skipped = f" Backends that could not be imported: {'; '.join(unavailable)}."
    raise NotACheckpointError(
        f"{path} is not a checkpoint in any registered format "
        f"({', '.join(sorted(_registry))}).{skipped} A plain TensorFlow SavedModel can be "
        f"opened with tf.saved_model.load or keras.layers.TFSMLayer instead. "
        f"Received: {str(path)!r}"
    )


def load_checkpoint(path: str | os.PathLike, **kwargs: Any) -> Checkpoint:
    """Detect the format of ``path`` and load it with the matching backend."""
    return detect_backend(path)().load(path, **kwargs)


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Metadata (with the training state) of the checkpoint at ``path``, model not built."""
    return detect_backend(path).read_metadata(Path(path))
