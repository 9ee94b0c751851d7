"""Float8-quantized layers (``model.quantize("float8")``) in a SavedModel.

A float8 ``Dense`` / ``EinsumDense`` comes back as Keras's own float8 layer: rebuilt from
its config, its variables paired with the saved ones by name (``records.rebuilt_order``).
That holds where a load rebuilds the layer from its own config, which is where a Functional
or Sequential model holds it. A layer that creates its sublayers itself (a custom block, a
subclassed model) rebuilds them unquantized: Keras's own ``.keras`` load and trainer's h5
and weights loads then fail on the variable count, and savedmodel would revive the holder
from its traced functions, whose float8 ops take their gradient from Python
(``tf.custom_gradient``), which a SavedModel does not hold: it would predict, then refuse
to train. The save refuses such a model instead, naming the layers.
"""

from __future__ import annotations

import keras

from trainer._compat import keras as keras_compat
from trainer.errors import ModelNotReadyError
from trainer.save_backends.savedmodel import records


def _is_float8(layer: keras.layers.Layer) -> bool:
    policy = getattr(layer, "dtype_policy", None)
    return isinstance(policy, keras.dtype_policies.QuantizedFloat8DTypePolicy)


def held_by_other_layers(model: keras.Model) -> list[str]:
    """``'inner' in 'block' (Block)`` for every float8 layer that a layer other than a
    Functional or Sequential graph holds, at any depth (the model itself included)."""
    found: dict[int, str] = {}
    if not any(_is_float8(layer) for layer in keras_compat.sublayers(model)):
        return []  # the common case: no config is serialized for the check
    for holder in keras_compat.sublayers(model, include_self=True):
        config, _ = records.keras_config(holder)
        if records.is_graph_config(records.model_kind(holder), config):
            continue
        for layer in keras_compat.sublayers(holder):
            if _is_float8(layer) and id(layer) not in found:
                found[id(layer)] = f"{layer.name!r} in {holder.name!r} ({type(holder).__name__})"
    return list(found.values())


def check_savable(model: keras.Model) -> None:
    """Refuse float8 layers no load could give back trainable (see the module's doc)."""
    held = held_by_other_layers(model)
    if held:
        raise ModelNotReadyError(
            f"Model {model.name!r} has float8-quantized layers inside layers that create "
            f"their sublayers themselves: {', '.join(held[:5])}. A load rebuilds those "
            f"unquantized, so it could not restore them (savedmodel could only revive them "
            f"from their traces, which cannot train float8 layers). Quantize only layers a "
            f"Functional or Sequential model holds directly, or save before "
            f"model.quantize('float8') and quantize after loading. Received: {len(held)} "
            f"float8 layers held that way"
        )
