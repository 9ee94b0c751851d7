"""Import legacy tf.keras (TensorFlow 2.x ``model.save(dir)``) SavedModels into Keras 3.

Modules: ``metadata_proto`` (our definition of ``keras_metadata.pb``), ``reader`` (the
directory, walked by object path), ``translate`` (Keras 2 -> 3 configs; ``nodes``: their
call graphs, ``activations``: Keras 2's ``hard_sigmoid``), ``weights``
(variables by structure), ``builtin`` (is a layer named like a Keras class that class?),
``standin`` (layers revived from traced functions),
``compiling`` and ``slots`` (compile config, optimizer state), ``importer`` (all of it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.save_backends.legacy.reader import is_legacy


def load_legacy(
    path: str | os.PathLike,
    *,
    custom_objects: dict[str, Any] | None = None,
    compile: bool = True,
) -> Any:
    """A ``LoadedCheckpoint`` holding the imported, compiled Keras 3 model and a fresh state."""
    from trainer.save_backends.base import LoadedCheckpoint
    from trainer.save_backends.legacy.importer import import_model
    from trainer.state import TrainingState

    path = Path(path)
    model, info = import_model(path, custom_objects=custom_objects, compile=compile)
    return LoadedCheckpoint(model=model, state=TrainingState(), metadata=info, path=path)


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What ``python -m trainer inspect`` shows for a legacy directory."""
    from trainer.save_backends.legacy.importer import describe as _describe

    return _describe(Path(path))


def refuse_metadata(path: Path) -> None:
    """A legacy directory has no trainer metadata (no training state to resume from)."""
    from trainer.errors import NotACheckpointError

    raise NotACheckpointError(
        f"{path} is a legacy tf.keras SavedModel: it holds a model but no trainer metadata "
        f"or training state. Load it with load_checkpoint(path) (a fresh state), or convert "
        f"it once with `python -m trainer import-legacy {path} DST`. Received: {str(path)!r}"
    )


__all__ = ["describe", "is_legacy", "load_legacy", "refuse_metadata"]
