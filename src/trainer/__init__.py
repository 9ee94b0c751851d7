"""trainer: Hydra-configured Keras 3 training with swappable save backends.

``train(cfg)`` is the whole training run; checkpoints go through
``trainer.save_backends`` (``get_backend``, ``load_checkpoint``). The package root is kept
light on purpose: ``import trainer`` (or ``trainer.errors``) imports no TensorFlow, Keras
or Hydra, and ``train`` is imported on first use.
"""

from __future__ import annotations

from typing import Any

from trainer import _moved
from trainer.version import __version__

_moved.install()  # old module paths keep importing for one release

__all__ = ["__version__", "train"]


def __getattr__(name: str) -> Any:  # PEP 562: lazy attributes of the package
    if name == "train":
        from trainer.training.loop import train

        return train
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
