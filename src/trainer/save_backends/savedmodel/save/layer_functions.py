"""The traced functions of one layer: its calls for each recorded input spec and
training value, its ``compute_mask``, its regularizers.

Split from ``object_graph``, which assembles the nodes of every layer into the root
module: this is what one layer's node holds, traced, and the errors that say which layer
could not be traced and why.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.errors import ModelNotReadyError
from trainer.save_backends.savedmodel.features import python_gradients
from trainer.save_backends.savedmodel.features.keras_objects import tf_variable
from trainer.save_backends.savedmodel.save import tracing
from trainer.save_backends.savedmodel.save.tracing import Node


def trace_layer(
    layer: keras.layers.Layer,
    node: Node,
    specs: dict[str, Any],
    dispatcher: Any = None,
    *,
    calls: bool = True,
    training: bool = True,
    unresolved: bool = False,
):
    """Concrete call functions for each recorded call spec, for both training values
    (none unless ``calls``; inference only unless ``training``), and with ``training``
    unresolved if ``unresolved`` (``call_default``)."""
    functions: dict[str, Any] = {}
    first_traced: dict[str, Any] = {}  # attribute -> its first concrete function
    python_gradient = False
    specs = (specs or _fallback_specs(layer)) if calls else {}
    summaries = [_spec_summary(s) for s in specs.values()]
    try:
        if specs:
            modes = {"call_infer": False, "call_train": True}
            if not tracing.training_matters(layer):
                modes = {"call_infer": None}
            elif not training:
                modes = {"call_infer": False}
            if unresolved and "call_infer" in modes and modes["call_infer"] is False:
                modes["call_default"] = None
            for attr, training in modes.items():
                fn = tracing.make_call_function(
                    layer, training, dispatcher, unresolved=attr == "call_default"
                )
                for args, kwargs in specs.values():
                    concrete = fn.get_concrete_function(
                        named(args, "args"), named(kwargs, "kwargs")
                    )
                    first_traced.setdefault(attr, concrete)
                    python_gradient = python_gradient or python_gradients.used(concrete)
                setattr(node, attr, fn)
                functions[attr] = f"{attr}"
        regs = []
        reg_vars = []
        for v in keras_compat.own_trainable_variables(layer):
            if getattr(v, "regularizer", None) is not None:
                regs.append(tracing.make_regularizer_function(v))
                reg_vars.append(id(tf_variable(v)))
        if regs:
            node.regularizer_functions = regs
            functions["regularizer_functions"] = len(regs)
        if getattr(layer, "activity_regularizer", None) is not None and "call_infer" in functions:
            concrete = first_traced["call_infer"]
            out = tf.nest.flatten(concrete.structured_outputs[0])[0]
            spec = tf.TensorSpec(out.shape, out.dtype)
            node.activity_regularizer_function = tracing.make_activity_function(layer, spec)
            functions["activity_regularizer_function"] = "activity_regularizer_function"
    except Exception as err:
        raise ModelNotReadyError(
            f"Layer {layer.name!r} ({type(layer).__name__}) could not be traced: "
            f"{type(err).__name__}: {err}. Its call must run inside a tf.function. "
            f"Received layer {layer.name!r}"
        ) from err
    return functions, summaries, python_gradient


def trace_compute_mask(layer: keras.layers.Layer, node: Node, specs: dict[str, Any]):
    """A traced ``compute_mask`` for a layer that overrides it, for every (input, mask)
    pair it was called with and for the same input without a mask: a layer revived from
    traces then hands downstream layers the masks the original would."""
    if not specs or not tracing.has_own_compute_mask(layer):
        return {}
    fn = tracing.make_compute_mask_function(layer)
    try:
        for inputs, mask in specs.values():
            for variant in (mask, tf.nest.map_structure(lambda _: None, mask)):
                fn.get_concrete_function(named(inputs, "inputs"), named(variant, "mask"))
    except Exception as err:
        raise ModelNotReadyError(
            f"Layer {layer.name!r} ({type(layer).__name__}): its compute_mask could not be "
            f"traced: {type(err).__name__}: {err}. It must run inside a tf.function on the "
            f"inputs and mask its call receives. Received layer {layer.name!r}"
        ) from err
    node.compute_mask = fn
    return {"compute_mask": "compute_mask"}


def _fallback_specs(layer: keras.layers.Layer) -> dict[str, Any]:
    """Specs for a layer the serving trace never called: children of a revived parent
    (whose traced function calls them inside), or layers used only in training."""
    revived_fn = live_objects.get_marker(layer, live_objects.TRACED_INFERENCE_CALL)
    found: dict[str, Any] = {}
    if revived_fn is not None:
        for concrete in tf_compat.concrete_functions(revived_fn):
            args = concrete.structured_input_signature[0]
            if len(args) == 2:
                found[repr(args)] = (tuple(args[0]), dict(args[1]))
        return found
    shapes = keras_compat.build_shapes(layer)
    if len(shapes) == 1:
        shape = list(next(iter(shapes.values())))
        if shape and all(isinstance(d, int | type(None)) for d in shape):
            spec = tf.TensorSpec([None, *shape[1:]], layer.input_dtype)
            found["build"] = ((spec,), {})
    return found


def named(structure: Any, prefix: str) -> Any:
    """Name specs the way tf.function names them in ``structured_input_signature``:
    tf.saved_model.save looks functions up again by that signature, and a spec whose name
    differs is a cache miss that silently traces the whole layer a second time."""

    def name(path: tuple, spec: Any) -> Any:
        if not isinstance(spec, tf.TensorSpec):
            return spec
        return tf.TensorSpec(spec.shape, spec.dtype, name="_".join([prefix, *map(str, path)]))

    return tf_compat.map_structure_with_tuple_paths(name, structure)


def _spec_summary(spec: tuple[Any, Any]) -> str:
    return repr(spec)[:500]
