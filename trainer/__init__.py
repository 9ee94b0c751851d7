"""trainer: Hydra-configured Keras 3 training with swappable save backends."""

__version__ = "0.1.0"

__all__ = ["__version__"]
