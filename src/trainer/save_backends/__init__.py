"""Save backends: one module per format, reached through the registry."""

from trainer.save_backends.base import Checkpoint, LoadedCheckpoint, SaveBackend
from trainer.save_backends.registry import (
    available_backends,
    backend_class,
    detect_backend,
    get_backend,
    load_checkpoint,
    read_checkpoint_metadata,
    register_backend,
)

__all__ = [
    "Checkpoint",
    "LoadedCheckpoint",
    "SaveBackend",
    "available_backends",
    "backend_class",
    "detect_backend",
    "get_backend",
    "load_checkpoint",
    "read_checkpoint_metadata",
    "register_backend",
]
