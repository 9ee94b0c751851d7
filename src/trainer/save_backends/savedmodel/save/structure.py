"""The structure fingerprint of a model: what must not change for a save to reuse the
traced graph of an earlier one (``trace_cache``). Computed on every save, so it reads only
identities and a few attributes, no values."""

from __future__ import annotations

import hashlib
import weakref

import keras

from trainer.model_state import config_check, kit
from trainer.save_backends.savedmodel.features import keras_objects
from trainer.save_backends.savedmodel.save import state_variables, tracing

# A private copy's (``kit.mark_private_copy``) last fingerprint, with what alone can
# change it: its flags and which variables it has. Computing the whole fingerprint was 1.1
# ms of the async writer's 8 ms per save, and the writer's CPU is what async saving costs
# the training loop (``benchmarks/async_cost.py``).
_PRIVATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fingerprint(model: keras.Model) -> str:
    """Changes whenever a save could no longer reuse the traced graph: layers added or
    rebuilt, variables replaced, trainable flags, config-held values
    (``config_check.held_values``) or the optimizer changed."""
    if not kit.is_private_copy(model):
        return _fingerprint(model)
    key = _private_copy_key(model)
    known = _PRIVATE.get(model)
    if known is not None and known[0] == key:
        return known[1]
    value = _fingerprint(model)
    _PRIVATE[model] = (key, value)
    return value


def _private_copy_key(model: keras.Model) -> tuple:
    """What can change in a private copy: trainable flags (of layers and variables),
    config-held values (``snapshot`` copies them from the model) and,
    should a variable be replaced, which variables it has (model and optimizer)."""
    saving_optimizer = kit.saving_optimizer()
    optimizer = getattr(model, "optimizer", None) if saving_optimizer else None
    optimizer_variables = optimizer.variables if optimizer is not None and optimizer.built else ()
    layers = tracing.all_layers(model)
    return (
        saving_optimizer,
        tuple(layer.trainable for layer in layers),
        tuple(config_check.held_values(layer) for layer in layers),
        tuple((id(v), v.trainable) for v in model.weights),
        id(optimizer),
        tuple(id(v) for v in optimizer_variables),
    )


def _fingerprint(model: keras.Model) -> str:
    parts = []
    for layer in tracing.all_layers(model):
        parts.append(f"L{id(layer)}:{type(layer).__name__}:{layer.name}:{layer.trainable}")
        parts.append(layer.dtype_policy.name)
        held = config_check.held_values(layer)
        if held:  # a dropout rate lowered, a re-adapted Discretization: records change
            parts.append(repr(held))
        for v in layer.variables:
            storage = keras_objects.variable_storage(v)
            parts.append(f"v{id(v)}:{id(storage)}:{tuple(v.shape)}:{v.dtype}:{v.trainable}")
        parts.extend(f"m{id(v)}" for v in state_variables.state_variables(layer))
    optimizer = getattr(model, "optimizer", None)
    if not kit.saving_optimizer():  # a serving export's graph has no optimizer
        optimizer = None
    parts.append(f"O{id(optimizer)}:{getattr(optimizer, 'built', None)}")
    if optimizer is not None and optimizer.built:
        parts.extend(
            f"o{id(v)}:{id(keras_objects.variable_storage(v))}" for v in optimizer.variables
        )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
