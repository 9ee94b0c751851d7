"""Save backends: one module per format, reached through the registry."""

from trainer._compat import call_records
from trainer.save_backends.base import Checkpoint, LoadedCheckpoint, SaveBackend
from trainer.save_backends.loading import load_checkpoint, read_checkpoint_metadata
from trainer.save_backends.registry import (
    available_backends,
    backend_class,
    detect_backend,
    get_backend,
    register_backend,
)

# From now on a model's calls are recorded: a SavedModel save of a subclassed model tries
# only the input kinds and dtypes it was called on (``call_records``).
call_records.install()

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
