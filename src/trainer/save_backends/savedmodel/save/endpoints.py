"""The serving endpoints of the SavedModel: ``serve`` and ``serving_default``.

Why both: what ``model.export(format="tf_saved_model")`` gives a server is an object whose
``serve(*args)`` takes the model's own positional arguments and returns the model's own
output structure, plus a ``serving_default`` signature with named inputs and outputs (TF
Serving, ``saved_model_cli``, ``TFSMLayer``). A trainer SavedModel offers both with the
same calling conventions, so it can replace a Keras export without changing its clients.

Why they are cheap: both are traced while every layer's ``call`` is dispatched to its
already traced function (``tracing.Dispatcher``), so ``serve`` holds one call of the root
layer's ``call_infer`` and ``serving_default`` one call of ``serve``, which only names
its outputs: the model's ops are traced and stored once.

The positional structure is the one Keras's export uses (``get_input_signature``: one
entry per positional argument of ``call``), with two corrections for subclassed models
whose ``call`` takes several tensors: entries follow ``call``'s parameter order (Keras
lists them in ``build``'s), and ``call(*inputs)`` gets one argument per input (Keras
records them as a single tuple).
"""

from __future__ import annotations

import inspect
import re
import weakref
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import keras_inputs as inputs_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.errors import ModelNotReadyError
from trainer.model_state import readiness
from trainer.save_backends.savedmodel.save import composites, input_signature

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NOT_INPUTS = ("training", "mask")


def _safe_name(name: str | None, fallback: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", name or "") or fallback
    return name if name[0].isalpha() else f"x_{name}"


# ------------------------------------------------------------------- positional inputs
def model_call_args(model: keras.Model) -> tuple[Any, ...]:
    """The positional arguments of the model's call, each a nested structure of
    ``tf.TensorSpec`` with the batch dimension free."""
    revived = revived_call_args(model)
    if revived is not None:
        return revived
    unlinked = input_signature.unlinked_sequential_input(model)
    if unlinked is not None:
        return (unlinked,)
    try:
        signature = list(inputs_compat.get_input_signature(model))
    except (ValueError, TypeError) as err:
        # Rebuilt from a config (an h5 or weights checkpoint): built, never called.
        recorded = inputs_compat.recorded_input_signature(model) if model.built else None
        if recorded is not None:
            return model_args_from(model, list(recorded))
        unrecorded = readiness.unrecorded_build_error(model, "savedmodel")
        if unrecorded is not None:  # built by its first call: "never called" would mislead
            raise unrecorded from None
        raise ModelNotReadyError(
            f"Cannot find the input signature of model {model.name!r}: {err} Call the model "
            f"on a batch of data before saving. Received {type(model).__name__}"
        ) from None
    return model_args_from(model, signature)


def model_args_from(model: keras.Model, signature: list[Any]) -> tuple[Any, ...]:
    """``model_call_args`` from Keras's input signature of ``model``."""
    names: list[str | None] = [None] * len(signature)
    if not (isinstance(model, keras.Sequential) or keras_compat.is_functional(model)):
        signature, names = _subclassed_positional(model, signature)
    args = []
    for arg, name in zip(signature, names, strict=True):
        arg = tf.nest.map_structure(
            lambda s: inputs_compat.make_tf_tensor_spec(s, dynamic_batch=True), arg
        )
        if name is not None and isinstance(arg, tf.TensorSpec) and len(signature) > 1:
            arg = tf.TensorSpec(arg.shape, arg.dtype, name=name)
        args.append(arg)
    args = input_signature.composite_inputs(model, tuple(args))
    return input_signature.declared_dtypes(model, args)


def revived_call_args(model: keras.Model) -> tuple[Any, ...] | None:
    """A model revived from traced functions is called as its traced ``call_infer`` was,
    with the trace of the dtypes its saved signature served, and its inputs keep the names
    that signature gave them (``keep_input_names``)."""
    function = live_objects.get_marker(model, live_objects.TRACED_INFERENCE_CALL)
    if function is None:
        return None
    candidates = []
    for concrete in tf_compat.concrete_functions(function):
        args = concrete.structured_input_signature[0]  # (positional, keywords) of call
        if args:
            candidates.append(tuple(args[0]))
    if not candidates:
        return None
    # The trace the saved signature served (int32 ids, not the float32 trace also made
    # for them): a re-save or export serves what the checkpoint did.
    served = live_objects.get_marker(model, live_objects.SERVING_INPUT_DTYPES)
    for args in candidates:
        if served and [s.dtype.name for s in tf.nest.flatten(args)] == served:
            break
    else:
        args = candidates[0]
    flat = tf.nest.flatten(args)
    names = live_objects.get_marker(model, live_objects.SERVING_INPUT_NAMES)
    specs_only = all(isinstance(s, tf.TensorSpec) for s in flat)
    if names is not None and len(names) == len(flat) and specs_only:
        flat = [tf.TensorSpec(s.shape, s.dtype, name=n) for s, n in zip(flat, names, strict=True)]
    return tf.nest.pack_sequence_as(args, flat)


def keep_input_names(model: keras.Model, signature: Any) -> None:
    """Remember the input names of the signature ``model`` was loaded from, so that a model
    revived from traced functions (whose specs are named ``args_<i>``) is saved again with
    the same ``serving_default`` input keys. ``signature`` is untrusted metadata."""
    try:
        names = [entry["name"] for entry in signature["inputs"]]
        dtypes = [entry.get("dtype") for entry in signature["inputs"]]
    except (TypeError, KeyError, IndexError, AttributeError):
        return
    if names and all(isinstance(n, str) for n in names):
        live_objects.set_marker(model, live_objects.SERVING_INPUT_NAMES, names)
    if dtypes and all(isinstance(d, str) for d in dtypes):
        live_objects.set_marker(model, live_objects.SERVING_INPUT_DTYPES, dtypes)


def _call_parameters(model: keras.Model) -> list[inspect.Parameter]:
    """Parameters of the class's ``call`` after ``self`` (the instance's ``call`` may be
    replaced while tracing)."""
    return list(inspect.signature(type(model).call).parameters.values())[1:]


def _subclassed_positional(
    model: keras.Model, signature: list[Any]
) -> tuple[list[Any], list[str | None]]:
    """Keras's signature of a subclassed model in ``call``'s positional order, with the
    name of each argument where Keras recorded it (``x_shape`` -> ``x``)."""
    params = _call_parameters(model)
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        if len(signature) == 1 and isinstance(signature[0], tuple | list):
            signature = list(signature[0])  # call(*inputs): one argument per input
        return signature, [None] * len(signature)
    position = {p.name: i for i, p in enumerate(params) if p.kind in _POSITIONAL}
    names = [key.removesuffix("_shape") for key in keras_compat.build_shapes(model)]
    if len(signature) > 1 and len(names) == len(signature) and set(names) <= set(position):
        order = sorted(range(len(names)), key=lambda i: position[names[i]])
        signature, names = [signature[i] for i in order], [names[i] for i in order]
    else:
        names = [None] * len(signature)
    required = [
        p.name
        for p in params
        if p.kind in _POSITIONAL and p.default is p.empty and p.name not in _NOT_INPUTS
    ]
    if len(signature) < len(required):
        kind = type(model).__name__
        raise ModelNotReadyError(
            f"Model {model.name!r} ({kind}) takes {len(required)} positional inputs "
            f"({', '.join(required)}) but Keras recorded the shapes of only {len(signature)} "
            f"when it was built (its build method takes a single input_shape), so it cannot "
            f"be traced for serving. Give {kind} a build method with one shape argument per "
            f"input, named after call's arguments (def build(self, "
            f"{', '.join(f'{n}_shape' for n in required)})), build or call it again, then "
            f"save. Received recorded shapes {sorted(keras_compat.build_shapes(model))}"
        )
    return signature, names


# ----------------------------------------------------------------------------- naming
def flat_named_specs(structure: Any, hints: list[str] | None = None) -> list[Any]:
    """Flattened input specs with unique names, which become the signature's input keys
    (dict keys, else the specs' names, else ``hints``: the model's Input names). A ragged
    or sparse spec has no name of its own: it is kept as it is, and ``input_names`` says
    what it is called."""
    return [
        tf.TensorSpec(s.shape, s.dtype, name=n) if isinstance(s, tf.TensorSpec) else s
        for s, n in zip(tf.nest.flatten(structure), input_names(structure, hints), strict=True)
    ]


def input_names(structure: Any, hints: list[str] | None = None) -> list[str]:
    """The unique signature name of every flattened input of ``structure``."""
    flat = tf.nest.flatten(structure)
    if isinstance(structure, dict):
        paths = [str(k) for k in sorted(structure)]
    else:
        paths = [None] * len(flat)
    if hints is None or len(hints) != len(flat):
        hints = [None] * len(flat)
    names: list[str] = []
    for i, (spec, key, hint) in enumerate(zip(flat, paths, hints, strict=True)):
        # The input layer's name before the tensor's: the same where the Input was named,
        # stable where Keras named it (its tensor took a counter: keras_tensor_47).
        name = _safe_name(key or hint or getattr(spec, "name", None), f"input_{i}")
        while name in names:
            name = f"{name}_{i}"
        names.append(name)
    return names


def output_dict(model: keras.Model, outputs: Any) -> dict[str, tf.Tensor]:
    """Name the model's outputs for the signature: a flat dict of tensors, one key each
    (dict keys, else the output names; a dict entry holding several tensors gives
    ``<key>_<j>``). Names that become equal once made valid (``a-b`` and ``a_b``) get a
    suffix: a signature output under a shared key replaced the other, silently."""
    if isinstance(outputs, dict):
        named = []
        for i, (key, value) in enumerate(outputs.items()):
            parts = tf.nest.flatten(value)
            if len(parts) == 1 and not isinstance(value, list | tuple | dict):
                named.append((_safe_name(str(key), f"output_{i}"), value))
            else:
                named += [
                    (_safe_name(f"{key}_{j}", f"output_{i}_{j}"), t) for j, t in enumerate(parts)
                ]
    else:
        flat = tf.nest.flatten(outputs)
        names = list(getattr(model, "output_names", None) or [])
        if len(names) != len(flat) or len(set(names)) != len(names):
            names = [f"output_{i}" for i in range(len(flat))]
        named = [
            (_safe_name(n, f"output_{i}"), t)
            for i, (n, t) in enumerate(zip(names, flat, strict=True))
        ]
    unique: dict[str, tf.Tensor] = {}
    for i, (name, tensor) in enumerate(named):
        while name in unique:
            name = f"{name}_{i}"
        unique[name] = tensor
    return unique


# -------------------------------------------------------------------------- functions
def named_args(
    args: tuple[Any, ...], model: keras.Model | None = None
) -> tuple[tuple[Any, ...], list[tf.TensorSpec], list[dict[str, Any]]]:
    """The positional specs renamed as the signature's input keys, the signature's inputs
    (dense: a ragged or sparse input is given as its components, see ``composites``) and
    the metadata of those composite inputs. A single argument is named as before several
    were supported (dict keys, Input names, else ``input_<i>``), so existing signatures
    keep their keys."""
    structure = args[0] if len(args) == 1 else args
    hints = None
    if model is not None and (
        isinstance(model, keras.Sequential) or keras_compat.is_functional(model)
    ):
        hints = inputs_compat.input_layer_names(model)
    names = input_names(structure, hints)
    flat = flat_named_specs(structure, hints)
    named = tf.nest.pack_sequence_as(structure, flat)
    specs = [c for s, n in zip(flat, names, strict=True) for c in composites.components(s, n)]
    described = [composites.describe(s, n) for s, n in zip(flat, names, strict=True)]
    named_args_ = (named,) if len(args) == 1 else tuple(named)
    return named_args_, specs, [d for d in described if d is not None]


def make_serve(model: keras.Model, args: tuple[Any, ...], *, training: bool = False) -> Any:
    """``serve(*args)``: the model in inference mode on its own positional structure,
    returning its own output structure, as Keras's export's ``serve``. With ``training``:
    the same in training mode, a throwaway probe of whether the model trains on ``args``."""
    ref = weakref.ref(model)  # the trace cache must not keep the model alive

    def serve(*inputs):
        target = ref()
        args, kwargs = _bound_inputs(target, inputs)
        outputs = target(*args, training=training, **kwargs)
        keras_compat.clear_losses(target)
        return outputs

    return tf.function(serve, input_signature=list(args))


def _bound_inputs(model: keras.Model, inputs: tuple[Any, ...]) -> tuple[tuple, dict]:
    """The recorded inputs as ``call`` takes them: positionally, except those its
    signature places after ``training`` (``call(self, a, training=None, b=None)``), which
    go by name; Keras takes ``training`` only by keyword, so ``model(a, b, training=...)``
    would hand ``b`` to ``training`` too."""
    call = type(model).call  # the class's: recording replaces ``call`` on the instance
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(call).parameters.values() if p.kind in positional]
    names = names[1:]  # without self
    if "training" not in names or names.index("training") >= len(inputs):
        return tuple(inputs), {}
    cut = names.index("training")
    return tuple(inputs[:cut]), dict(zip(names[cut + 1 :], inputs[cut:], strict=False))


def make_serving_default(
    model: keras.Model, serve: Any, args: tuple[Any, ...], specs: list[tf.TensorSpec]
) -> Any:
    """``serving_default(*args)``: ``serve`` with its outputs named (a flat dict), which is
    what a SavedModel signature needs. ``serve``'s captured variables become inputs of
    the signature's function: they are captured first under valid argument names
    (``captured_<i>``), not TensorFlow's numeric ids, which the save would rename. A model
    taking ragged or sparse inputs gets them as their dense components (``specs``), which
    the function reassembles: a signature takes dense tensors only."""
    ref = weakref.ref(model)
    composite = any(composites.is_composite(s) for s in tf.nest.flatten(args))

    def serving_default(*inputs):
        if composite:
            inputs = composites.unflatten(args, list(inputs))
        captured = serve.get_concrete_function(*inputs).captured_inputs
        for i, value in enumerate(captured):
            tf_compat.capture_named(value, f"captured_{i}")
        return output_dict(ref(), serve(*inputs))

    return tf.function(serving_default, input_signature=specs if composite else list(args))
