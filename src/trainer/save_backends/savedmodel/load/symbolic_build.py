"""Building a layer rebuilt from its config by calling it on symbolic inputs.

Most custom blocks create their sublayers in ``__init__`` and define no ``build()``: Keras
builds them on their first call, by running ``call`` on symbolic tensors, which builds the
sublayers. Their default ``build()`` creates nothing, so ``build_from_config`` leaves such a
layer without its sublayers' weights (and Keras warns that it marked it built anyway). The
loader builds it the way its first call did instead: a call on symbolic inputs of the
shapes its build config recorded, as Keras's own ``Model.build_from_config`` does for a
model without ``build()``. That needs neither the traced functions (importing them made
such a load several times slower than Keras's ``.keras``) nor any code from the checkpoint:
the call runs the layer's own class, found in this process.

The recorded shapes say nothing of dtypes: the inputs are of Keras's default float dtype,
as in Keras's own loader. Whatever the call builds is checked by the caller against the
saved variables (count, then shape and dtype by position) before any value is bound; a
layer that does not match is revived the previous way, from its traced input specs.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat


def builds_by_call(layer: keras.layers.Layer) -> bool:
    """A plain layer (not a model: ``Model.build_from_config`` calls it itself) keeping
    Keras's default ``build`` and holding sublayers not built yet: only a call builds it."""
    if isinstance(layer, keras.Model) or type(layer).build is not keras.layers.Layer.build:
        return False
    return any(not sub.built for sub in keras_compat.sublayers(layer))


def inputs_from_build_config(build_config: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Symbolic ``(args, kwargs)`` of the shapes a build config records: ``input_shape``
    (the first argument, possibly nested) or ``shapes_dict`` (one ``<name>_shape`` per
    argument). Raises ``ValueError`` for any other (a damaged or custom build config)."""
    if not isinstance(build_config, dict):
        raise ValueError(f"no build config to call the layer with: {build_config!r:.200}")
    if "input_shape" in build_config:
        return (_symbolic(build_config["input_shape"]),), {}
    shapes = build_config.get("shapes_dict")
    if isinstance(shapes, dict) and shapes and all(k.endswith("_shape") for k in shapes):
        return (), {k[: -len("_shape")]: _symbolic(s) for k, s in shapes.items()}
    raise ValueError(f"build config without input shapes: {sorted(build_config)!r:.200}")


def build_by_call(layer: keras.layers.Layer, build_config: Any) -> None:
    """Build ``layer`` as a call on the shapes of its build config would (the build only:
    the call's output is not needed); raises what the call raises. Quietly: when Keras
    cannot trace the call it warns, and the caller, seeing the variables missing, builds
    the layer from its traced input specs instead."""
    args, kwargs = inputs_from_build_config(build_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras_compat.build_as_first_call(layer, args, kwargs)


def _symbolic(shapes: Any) -> Any:
    return keras.tree.map_shape_structure(lambda shape: keras.KerasTensor(tuple(shape)), shapes)


def inputs_from_specs(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Symbolic ``(args, kwargs)`` of a traced call's input signature, each tensor of its
    kind (dense, sparse or ragged); other values as they are."""

    def to_keras(spec: Any) -> Any:
        if isinstance(spec, tf.TensorSpec):
            return keras.KerasTensor(spec.shape, spec.dtype.name)
        if isinstance(spec, tf.SparseTensorSpec):
            return keras.KerasTensor(spec.shape, spec.dtype.name, sparse=True)
        if isinstance(spec, tf.RaggedTensorSpec):
            return keras.KerasTensor(spec.shape, spec.dtype.name, ragged=True)
        return spec

    return (
        tf.nest.map_structure(to_keras, tuple(args)),
        tf.nest.map_structure(to_keras, dict(kwargs)),
    )


def call(layer: keras.layers.Layer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Call ``layer`` symbolically (which builds it and what its call uses), then forget
    the call: it is part of no graph, and a Functional model rebuilt around the layer must
    number its nodes as the saved config does."""
    try:
        layer(*args, **kwargs)
    finally:
        keras_compat.forget_call_nodes(layer)
