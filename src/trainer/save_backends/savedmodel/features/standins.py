"""Layers and models that stand in for a class that is not available at load time.

A revived layer keeps the saved name and reports the saved class name (a subclass is made
per class name), owns Keras variables whose storage *is* the loaded ``tf.Variable`` that
the traced functions captured (so training one trains the other), holds its revived
sublayers under their original attribute names, and calls the traced function for the
current ``training`` value. Losses the traced call produced are re-added with ``add_loss``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import keyword
import re
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.errors import RevivedCallError
from trainer.save_backends.savedmodel.features import (
    call_matching,
    frozen_flags,
    keras_objects,
    masks,
    python_gradients,
    unmatched_calls,
)


class TracedRegularizer(keras.regularizers.Regularizer):
    """A weight regularizer replayed from its traced, argument-free loss function."""

    def __init__(self, function: Any):
        self.function = function

    def __call__(self, x: Any) -> Any:
        return self.function()

    def get_config(self) -> dict[str, Any]:
        return {}


def attach_seed_generators(
    layer: keras.layers.Layer, states: list[tuple[dict[str, Any], tf.Variable]]
) -> None:
    """Give ``layer`` back the ``keras.random.SeedGenerator`` objects it held, each over the
    loaded state its traced functions draw from: a seed state is one of ``layer.variables``
    but not of ``layer.weights``; wrapped as a plain variable it would become a weight
    (one more entry in ``get_weights()`` than the original had)."""
    for position, (record, storage) in enumerate(states):
        parts = (record.get("path") or "").split("/")
        scopes, name = (parts[:-2], parts[-2]) if len(parts) > 1 and all(parts) else ([], None)
        with keras_compat.name_scopes(scopes):
            generator = keras.random.SeedGenerator(seed=0, name=name)
        keras_compat.set_variable_storage(generator.state, storage)
        setattr(layer, f"revived_seed_generator_{position}", generator)


def _set_child(owner: keras.layers.Layer, attribute: str, child: keras.layers.Layer) -> None:
    match = re.fullmatch(r"(\w+)\[(\d+)\]", attribute)
    if match is None:
        setattr(owner, attribute, child)
        return
    name, position = match.group(1), int(match.group(2))
    current = list(getattr(owner, name, None) or [])
    while len(current) <= position:
        current.append(None)
    current[position] = child
    setattr(owner, name, current)


class _RevivedMixin:
    """Behaviour shared by revived layers and models (kept out of ``__init__`` so both
    base classes' constructors stay untouched). The class carries
    ``live_objects.REVIVED_FROM`` (set below): backends that store configs only refuse
    such layers. What a stand-in calls and reports lives in markers on the instance
    (``live_objects``), which Keras must not track as layer state."""

    def _setup_from_saved(self, record, node, children, own_variables) -> None:
        original = {
            "class_name": record["class_name"],
            "module": record["module"],
            "registered_name": record["registered_name"],
            "keras_config": record["keras_config"],
            "config_error": record.get("config_error"),
            "carries_code": record["carries_code"],
            "model_kind": record["model_kind"],
        }
        infer = getattr(node, "call_infer", None)
        mark = live_objects.set_marker
        mark(self, live_objects.ORIGINAL_IDENTITY, original)
        mark(self, live_objects.TRACED_INFERENCE_CALL, infer)
        mark(self, live_objects.TRACED_TRAINING_CALL, getattr(node, "call_train", None))
        mark(self, live_objects.TRACED_DEFAULT_CALL, getattr(node, "call_default", None))
        mark(self, live_objects.TRAINING_WAS_TRACED, record.get("training_traced", True))
        untrainable = not python_gradients.trainable_when_revived(record)
        mark(self, live_objects.PYTHON_GRADIENT, untrainable)
        signature = inspect.signature(type(self).call)
        parameters = list(signature.parameters.values())[1:]  # without self
        mark(self, live_objects.CALL_SIGNATURE, signature.replace(parameters=parameters))
        saved = record.get("call_signature")
        saved = [p for p in saved if isinstance(p, dict)] if isinstance(saved, list) else []
        opaque = {p.get("name") for p in saved if p.get("opaque") is True}
        mark(self, live_objects.OPAQUE_DEFAULTS, opaque)
        mark(self, live_objects.TRACED_COMPUTE_MASK, getattr(node, "compute_mask", None))
        mark(self, live_objects.TAKES_INPUT_MASKS, masks.accepts_masks(infer))
        # Records written before masks were recorded: Keras' default for a layer with
        # its own compute_mask, which every revived layer has.
        self.supports_masking = record.get("supports_masking", True)
        for attributes, child in children:
            names = [a for a in attributes if a != "_layers"]
            if not names:
                names = [f"sublayer_{len(keras_compat.tracked_sublayers(self))}"]
            for attribute in names:
                _set_child(self, attribute, child)
        for variable in own_variables:
            keras_compat.track_variable(self, variable)
        structure = _first_args(infer)
        if structure is not None:
            mark(self, live_objects.INPUT_STRUCTURE, structure)
        mark(self, live_objects.FROZEN_FLAGS, frozen_flags.snapshot(self))
        spec = keras_objects.input_spec_from_record(record.get("input_spec"))
        if spec is not None:
            self.input_spec = spec
        self.built = True

    def _call_traced(self, args, training, kwargs):
        """The traced call for this ``training`` value, on the arguments as received (and
        the masks their tensors carry, if it was traced with masks)."""
        marker = functools.partial(live_objects.get_marker, self)
        function = marker(live_objects.TRACED_INFERENCE_CALL)
        if training and marker(live_objects.PYTHON_GRADIENT):
            raise python_gradients.refuse_training(self)
        if training and marker(live_objects.TRACED_TRAINING_CALL) is not None:
            frozen_flags.check(self, marker(live_objects.FROZEN_FLAGS))
            function = marker(live_objects.TRACED_TRAINING_CALL)
        elif training and not marker(live_objects.TRAINING_WAS_TRACED):
            raise _no_training_trace(self)
        elif training is None and marker(live_objects.TRACED_DEFAULT_CALL) is not None:
            # unresolved: each sublayer took its own default, some of them training
            frozen_flags.check(self, marker(live_objects.FROZEN_FLAGS))
            function = marker(live_objects.TRACED_DEFAULT_CALL)
        takes_masks = marker(live_objects.TAKES_INPUT_MASKS)
        error = None
        for each_args, each_kwargs in call_matching.arrange(self, function, args, kwargs):
            if takes_masks:
                each_kwargs = masks.with_masks(each_args, each_kwargs)
            try:
                result = function(each_args, each_kwargs)
                break
            except (TypeError, ValueError) as err:  # no trace takes these tensors
                error = err
        else:
            raise unmatched_calls.unmatched_call(self, function, args, kwargs, error) from error
        outputs, losses = masks.received(result)
        for loss in losses:
            self.add_loss(loss)
        return outputs

    def compute_output_spec(self, *args, **kwargs):
        """Keras' TensorFlow backend infers output specs by calling ``call`` on dense
        placeholders, even for a ragged ``KerasTensor``; the traces of a layer taking
        ragged rows take no dense tensor, so its outputs are read from the trace taking
        the same kinds of tensors instead (the original layer declared its output shape
        itself, which a stand-in cannot)."""
        flat = [x for x in tf.nest.flatten(args) if isinstance(x, keras.KerasTensor)]
        if not any(x.ragged for x in flat):
            return super().compute_output_spec(*args, **kwargs)
        function = live_objects.get_marker(self, live_objects.TRACED_INFERENCE_CALL)
        return _traced_output_spec(function, flat)

    def compute_mask(self, inputs, previous_mask=None):
        """The original layer's traced ``compute_mask``; without one, Keras' default."""
        function = live_objects.get_marker(self, live_objects.TRACED_COMPUTE_MASK)
        if function is None:
            return previous_mask
        if any(map(keras.utils.is_keras_tensor, tf.nest.flatten(inputs))):  # graph building
            return _symbolic_mask(function, previous_mask)
        return function(inputs, previous_mask)

    def get_config(self) -> dict[str, Any]:
        original = live_objects.get_marker(self, live_objects.ORIGINAL_IDENTITY)
        config = (original.get("keras_config") or {}).get("config") or {}
        return {**config, "name": self.name, "trainable": self.trainable}


live_objects.set_marker(_RevivedMixin, live_objects.REVIVED_FROM, "a trainer SavedModel")


def _no_training_trace(layer: Any) -> Exception:
    """The error for ``training=True`` on a layer revived from a serving export: the export
    holds its inference trace only, so its training behaviour (dropout, batch statistics)
    is not in the file, and using the inference trace would train something else."""
    return RevivedCallError(
        f"Layer {layer.name!r} ({type(layer).__name__}) was revived from a serving export "
        f"without its class, and a serving export holds only the layer's inference trace: "
        f"it cannot run with training=True (fit, or a call in training mode). Fine-tune from "
        f"a checkpoint of the run, export with `--with-optimizer` (`export.with_optimizer="
        f"true`), which keeps the training traces, or make the layer's class importable. "
        f"Received: training=True"
    )


def _kind(value: Any) -> str:
    if isinstance(value, tf.RaggedTensorSpec | tf.RaggedTensor):
        return "ragged"
    if isinstance(value, tf.SparseTensorSpec | tf.SparseTensor):
        return "sparse"
    if isinstance(value, keras.KerasTensor):
        return "ragged" if value.ragged else "sparse" if value.sparse else "dense"
    return "dense"


def _traced_output_spec(function: Any, inputs: list[keras.KerasTensor]) -> Any:
    """The outputs (as ``KerasTensor``s) of the trace whose tensor inputs are of the
    kinds of ``inputs``; without one, the call is refused as ``_call_traced`` would."""
    wanted = [_kind(x) for x in inputs]
    for concrete in _concretes(function):
        traced = [x for x in tf.nest.flatten(concrete.structured_input_signature[0][0])]
        tensors = [x for x in traced if isinstance(x, tf.TypeSpec)]
        if [_kind(x) for x in tensors] == wanted:
            outputs = concrete.structured_outputs[0]
            break
    else:
        given = [f"{k} {x.shape} {x.dtype}" for k, x in zip(wanted, inputs, strict=True)]
        raise RevivedCallError(
            f"A layer revived from its traced functions has no trace taking {wanted} tensors "
            f"(its class was not available at load time). Call it with the kinds of tensors "
            f"the original layer was called with, or make its class importable. Received: "
            f"{given}"
        )

    def symbolic(value: Any) -> Any:
        if value is None or not hasattr(value, "shape"):
            return value
        kind = _kind(value)
        return keras.KerasTensor(
            value.shape, value.dtype, ragged=kind == "ragged", sparse=kind == "sparse"
        )

    return tf.nest.map_structure(symbolic, outputs)


def _symbolic_mask(function: Any, previous_mask: Any) -> Any:
    """The mask a traced ``compute_mask`` returns, as symbolic tensors, for a Functional
    graph being built: from the trace that had a mask exactly when this call has one."""
    has_mask = any(m is not None for m in tf.nest.flatten(previous_mask))
    concretes = _concretes(function)
    for concrete in concretes:
        traced_mask = concrete.structured_input_signature[0][1]
        if any(m is not None for m in tf.nest.flatten(traced_mask)) == has_mask:
            break
    else:
        concrete = concretes[0]

    def symbolic(spec: Any) -> Any:
        return None if spec is None else keras.KerasTensor(spec.shape, spec.dtype)

    outputs = concrete.structured_outputs
    if outputs is None:
        return None
    return tf.nest.map_structure(symbolic, outputs)


def _concretes(function: Any) -> list[Any]:
    if function is None:
        return []
    return tf_compat.concrete_functions(function)


def _first_args(function: Any) -> Any:
    for concrete in _concretes(function):
        args, _ = concrete.structured_input_signature
        if args and len(args[0]) == 1:
            return args[0][0]
        if args:
            return tuple(args[0])
    return None


def _kwarg_names(function: Any) -> set[str]:
    """Keyword arguments the traced call was traced with."""
    names: set[str] = set()
    for concrete in _concretes(function):
        args, _ = concrete.structured_input_signature
        if len(args) > 1 and isinstance(args[1], dict):
            names.update(args[1])
    return names


class RevivedLayer(_RevivedMixin, keras.layers.Layer):
    """Stand-in for a layer whose class is unknown at load time."""


class RevivedModel(_RevivedMixin, keras.Model):
    """Stand-in for a subclassed ``keras.Model`` whose class is unknown at load time."""


class RevivedLambda(RevivedLayer, keras.layers.Lambda):
    """Stand-in for a ``keras.layers.Lambda`` loaded in safe mode: its Python function is
    not run from the file, so the layer runs its traced function, but it stays a
    ``Lambda`` (``isinstance`` checks hold). ``function`` is the inference trace; its
    config is the saved one, marked as revived (``REVIVED_CONFIG_KEY``), so it can never
    pass for a Lambda rebuilt from its code."""

    def __init__(self, **kwargs):
        super().__init__(function=self._inference_trace, **kwargs)

    def _inference_trace(self, inputs):
        return self._call_traced((inputs,), False, {})

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), REVIVED_CONFIG_KEY: "traced functions"}


# In a revived Lambda's config: what it runs instead of the saved function's code.
REVIVED_CONFIG_KEY = "trainer_revived_from"


class RevivedStatefulRNN(RevivedLayer):
    """Stand-in for a stateful RNN (a ``keras.layers.RNN`` subclass) whose class is
    unknown at load time: its ``states`` are the loaded variables its traced functions
    read and update (set by ``rnn_states.expose``), so reading, assigning and resetting
    them act on what it computes with, as on the original."""

    stateful = True
    states: list[keras.Variable]

    def reset_state(self) -> None:
        for variable in self.states:
            variable.assign(keras.ops.zeros_like(variable.value))

    def reset_states(self) -> None:  # Keras' compatibility alias
        self.reset_state()


_KINDS = {
    kind.name: kind
    for kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
}


def _call(self, *args, **kwargs):
    """``call`` of every stand-in; its class gives it the original's signature, so Keras
    binds a call exactly as it bound the original's (which argument is the first input,
    whether it passes ``training`` and ``mask``: a ``call`` without ``training`` is called
    without it, and reads the value Keras hands down through its call context, as the
    original's sublayers would)."""
    training = kwargs.pop("training") if "training" in kwargs else keras_compat.outer_training()
    return self._call_traced(args, training, kwargs)


def _parameter(saved: dict[str, Any]) -> inspect.Parameter:
    """One parameter of a recorded signature (untrusted: names and defaults checked)."""
    name = saved["name"]
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"not a parameter name: {name!r}")
    default = saved.get("default", inspect.Parameter.empty)
    plain = default is inspect.Parameter.empty or default is None
    if not (plain or isinstance(default, bool | int | float | str)):
        raise ValueError(f"not a plain default: {default!r}")
    return inspect.Parameter(name, _KINDS[saved["kind"]], default=default)


def call_signature(record: dict[str, Any], takes_mask: bool) -> inspect.Signature:
    """The signature of the original ``call`` (with ``self``) as its record has it, or
    for records without one (or a damaged one), ``(inputs, *args, training, mask,
    **kwargs)`` with ``training`` and ``mask`` as the original declared them."""
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    with contextlib.suppress(TypeError, ValueError, KeyError):
        saved = record.get("call_signature")
        if isinstance(saved, list):
            params = [_parameter(p) for p in saved]
            return inspect.Signature([self_param, *params])
    params = [
        self_param,
        inspect.Parameter("inputs", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
    ]
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    if record.get("takes_training", True):
        params.append(inspect.Parameter("training", keyword_only, default=None))
    if takes_mask:
        params.append(inspect.Parameter("mask", keyword_only, default=None))
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


_CLASSES: dict[tuple[str, type, str], type] = {}


def revived_class(class_name: str, base: type, signature: inspect.Signature) -> type:
    """A subclass of ``base`` named like the saved class, so ``type(layer).__name__``
    still tells what the layer was, whose ``call`` has the original's ``signature``."""
    key = (class_name, base, str(signature))
    if key not in _CLASSES:
        name = class_name if class_name.isidentifier() else "Revived"

        def call(self, *args, **kwargs):
            return _call(self, *args, **kwargs)

        call.__doc__ = _call.__doc__
        call.__signature__ = signature
        body = {"__module__": __name__, "call": call}
        _CLASSES[key] = type(name, (base,), body)
    return _CLASSES[key]


def make_revived(
    record: dict[str, Any],
    node: Any,
    children: list[tuple[list[str], keras.layers.Layer]],
    own_variables: list[keras.Variable],
    dtype: Any,
) -> keras.layers.Layer:
    # Any model (also a Functional subclass revived from its traces) stands in as a model.
    base = RevivedModel if record["model_kind"] else RevivedLayer
    if base is RevivedLayer and record.get("rnn_states"):
        base = RevivedStatefulRNN
    if base is RevivedLayer and _is_keras_lambda(record):
        base = RevivedLambda
    takes_mask = "mask" in _kwarg_names(getattr(node, "call_infer", None))
    cls = revived_class(record["class_name"], base, call_signature(record, takes_mask))
    layer = cls(
        name=record["name"], trainable=record["trainable"], dtype=dtype, autocast=_autocast(record)
    )
    layer._setup_from_saved(record, node, children, own_variables)
    return layer


def _is_keras_lambda(record: dict[str, Any]) -> bool:
    """Whether the saved layer was Keras' own ``Lambda`` (not a subclass of it)."""
    module = record.get("module") or ""
    return record["class_name"] == "Lambda" and module.startswith("keras.")


def _autocast(record: dict[str, Any]) -> bool:
    """Whether the original cast its float inputs to its compute dtype (Keras' default,
    and its config says so when not): a stand-in that autocast where the original did not
    would hand its traces float32 where they were traced on the float64 the model feeds."""
    config = (record.get("keras_config") or {}).get("config") or {}
    return config.get("autocast") is not False
