"""trainer: Hydra-configured Keras 3 training with swappable save backends.

``train(cfg)`` is the whole training run; checkpoints go through
``trainer.save_backends`` (``get_backend``, ``load_checkpoint``). Importing the package
registers the project's own serializable classes (model zoo, pruning wrapper), so any
process that imports trainer can load checkpoints that use them.
"""

from trainer import models, pruning  # noqa: F401  (registers serializable classes)
from trainer.training import train
from trainer.version import __version__

__all__ = ["__version__", "train"]
