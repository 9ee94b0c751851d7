"""The structure fingerprint of a model: what must not change for a save to reuse the
traced graph of an earlier one (``trace_cache``). Computed on every save, so it reads only
identities and a few attributes, no values."""

from __future__ import annotations

import hashlib

import keras

from trainer.save_backends import modelstate
from trainer.save_backends.savedmodel import state_variables, tracing


def fingerprint(model: keras.Model) -> str:
    """Changes whenever a save could no longer reuse the traced graph: layers added or
    rebuilt, variables replaced, trainable flags or the optimizer changed."""
    parts = []
    for layer in tracing.all_layers(model):
        parts.append(f"L{id(layer)}:{type(layer).__name__}:{layer.name}:{layer.trainable}")
        parts.append(layer.dtype_policy.name)
        for v in layer.variables:
            storage = tracing.variable_storage(v)
            parts.append(f"v{id(v)}:{id(storage)}:{tuple(v.shape)}:{v.dtype}:{v.trainable}")
        parts.extend(f"m{id(v)}" for v in state_variables.state_variables(layer))
    optimizer = getattr(model, "optimizer", None)
    if not modelstate.saving_optimizer():  # a serving export's graph has no optimizer
        optimizer = None
    parts.append(f"O{id(optimizer)}:{getattr(optimizer, 'built', None)}")
    if optimizer is not None and optimizer.built:
        parts.extend(f"o{id(v)}:{id(tracing.variable_storage(v))}" for v in optimizer.variables)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
