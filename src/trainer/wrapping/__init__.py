"""Wrap chosen layers of a model for training (at any depth), and strip the wrappers again.

``trainer.wrapping.core`` is the kind-agnostic rewriter; each wrapper kind registers itself
with :func:`register_wrap_kind` (``trainer.wrapping.pruning`` is the built-in one, imported
here so that ``wrap=prune`` and its serializable classes are always available).
"""

from trainer.wrapping import pruning
from trainer.wrapping.core import (
    PACKAGE,
    TrainingWrapper,
    WrapHost,
    apply_wrap,
    copy_model,
    custom_objects,
    find_layers,
    register_wrap_kind,
    unwrap_model,
    wrap_model,
)

__all__ = [
    "PACKAGE",
    "TrainingWrapper",
    "WrapHost",
    "apply_wrap",
    "copy_model",
    "custom_objects",
    "find_layers",
    "pruning",
    "register_wrap_kind",
    "unwrap_model",
    "wrap_model",
]
