"""trainer: Hydra-configured Keras 3 training with swappable save backends.

``train(cfg)`` is the whole training run; checkpoints go through
``trainer.save_backends`` (``get_backend``, ``load_checkpoint``).
"""

from trainer.training import train
from trainer.version import __version__

__all__ = ["__version__", "train"]
