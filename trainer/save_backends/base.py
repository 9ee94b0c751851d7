"""The contract every save backend fulfils, and the parts they all share.

A backend only implements ``_write`` / ``_read`` and ``can_load``; atomic publication,
metadata, validation of the model and of the path live here once.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as _dt
import os
from pathlib import Path
from typing import Any, ClassVar

import keras
import tensorflow as tf

from trainer.atomic import atomic_write, is_temporary
from trainer.errors import IncompatibleFormatError, ModelNotReadyError, NotACheckpointError
from trainer.state import TrainingState
from trainer.version import __version__


@dataclasses.dataclass
class Checkpoint:
    """What a backend returns from ``load``."""

    model: keras.Model
    state: TrainingState
    metadata: dict[str, Any]
    path: Path


class SaveBackend(abc.ABC):
    """Abstract save backend: ``save`` a model with its training state, ``load`` it back.

    Subclasses set ``name`` and ``format_version`` and say whether a checkpoint is one file
    (``is_directory = False``, with ``suffix``) or a directory.
    """

    name: ClassVar[str]
    format_version: ClassVar[int] = 1
    is_directory: ClassVar[bool] = True
    suffix: ClassVar[str] = ""
    # Whether the checkpoint callback writes in a background thread unless told otherwise.
    async_by_default: ClassVar[bool] = False

    # ----------------------------------------------------------------- public API
    def save(
        self,
        model: keras.Model,
        path: str | os.PathLike,
        *,
        state: TrainingState | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Path:
        """Write ``model`` (weights, optimizer, compile config) and ``state`` to ``path``.

        ``metadata`` adds caller information (for example the run's Hydra config) to the
        checkpoint's metadata. The checkpoint appears at ``path`` complete or not at all.
        """
        path = self.checkpoint_path(path)
        check_model_ready(model)
        state = state if state is not None else TrainingState()
        meta = self.build_metadata(model, state, metadata or {})
        with atomic_write(path, directory=self.is_directory) as tmp:
            self._write(model, tmp, state, meta)
        return path

    def load(
        self,
        path: str | os.PathLike,
        *,
        custom_objects: dict[str, Any] | None = None,
        compile: bool = True,
        **options: Any,
    ) -> Checkpoint:
        """Read a checkpoint written by this backend; the model comes back compiled as saved.

        ``options`` are backend-specific (for example ``safe_mode`` or ``model``) and are
        passed on to ``_read``; a backend that takes none rejects them with a TypeError.
        """
        path = Path(path)
        if not path.exists():
            raise NotACheckpointError(
                f"No checkpoint at {path}: the path does not exist. Check the path, or list "
                f"a run's checkpoints with `python -m trainer inspect`. Received: {str(path)!r}"
            )
        if is_temporary(path) or not type(self).can_load(path):
            raise NotACheckpointError(
                f"{path} is not a complete {self.name!r} checkpoint. Load it with "
                f"`trainer.save_backends.load_checkpoint`, which detects the format. "
                f"Received: {str(path)!r}"
            )
        checkpoint = self._read(
            path, custom_objects=custom_objects or {}, compile=compile, **options
        )
        self.check_format_version(checkpoint.metadata, path)
        return checkpoint

    @classmethod
    @abc.abstractmethod
    def can_load(cls, path: Path) -> bool:
        """Cheap check (no model built) whether ``path`` is a complete checkpoint of ours."""

    @classmethod
    def read_metadata(cls, path: Path) -> dict[str, Any]:
        """The checkpoint's metadata (including ``state``) without building the model.

        Backends override this with a cheap reader; the fallback loads the checkpoint.
        """
        return cls().load(path, compile=False).metadata

    def checkpoint_path(self, path: str | os.PathLike) -> Path:
        """The final path a checkpoint at ``path`` gets (adds the file suffix if missing)."""
        path = Path(path)
        if self.suffix and not path.name.endswith(self.suffix):
            path = path.with_name(path.name + self.suffix)
        return path

    # -------------------------------------------------------------- metadata hooks
    def build_metadata(
        self, model: keras.Model, state: TrainingState, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """Metadata common to every backend; subclasses may extend it."""
        meta = {
            "format": "trainer-checkpoint",
            "backend": self.name,
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
        meta.update(extra)
        return meta

    def check_format_version(self, metadata: dict[str, Any], path: Path) -> None:
        version = metadata.get("format_version")
        if not isinstance(version, int) or version > self.format_version:
            raise IncompatibleFormatError(
                f"{path} was written in {self.name!r} format version {version!r}, but this "
                f"trainer reads versions up to {self.format_version}. Upgrade trainer to load "
                f"it. Received format_version={version!r}"
            )

    # ------------------------------------------------------------ implementation
    @abc.abstractmethod
    def _write(
        self, model: keras.Model, tmp: Path, state: TrainingState, metadata: dict[str, Any]
    ) -> None:
        """Write everything into ``tmp`` (a fresh directory, or a file path to create)."""

    @abc.abstractmethod
    def _read(self, path: Path, *, custom_objects: dict[str, Any], compile: bool) -> Checkpoint:
        """Rebuild the model and state from a complete checkpoint at ``path``."""


def check_model_ready(model: Any) -> None:
    """Refuse to save what cannot be saved faithfully, before anything is written."""
    if not isinstance(model, keras.Model):
        raise ModelNotReadyError(
            f"Only Keras 3 models can be saved; wrap layers in a keras.Model first. "
            f"Received an object of type {type(model).__module__}.{type(model).__name__}"
        )
    unbuilt = [layer.name for layer in _all_layers(model) if not layer.built]
    if not model.built or unbuilt:
        names = ", ".join(unbuilt[:5]) or model.name
        raise ModelNotReadyError(
            f"Model {model.name!r} is not built (unbuilt layers: {names}), so its weights do "
            f"not exist yet. Call the model on a batch of data, call model.build(input_shape), "
            f"or train it before saving. Received model {model.name!r} "
            f"({type(model).__name__})"
        )


def _all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    seen: dict[int, keras.layers.Layer] = {}
    stack = list(getattr(model, "_flatten_layers", lambda **_: [])(include_self=False))
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen[id(layer)] = layer
        stack.extend(layer._flatten_layers(include_self=False))
    return list(seen.values())
