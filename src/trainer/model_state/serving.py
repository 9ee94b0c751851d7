"""The serving function of a model, and cheap reading of a SavedModel's signatures.

One place builds the inference function, so the graph written to TensorBoard's Graphs tab
is the very function exported as ``serving_default``. Signatures are read from
``saved_model.pb`` as a protobuf, without loading any function or variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from trainer._compat import keras as keras_compat
from trainer._compat import keras_inputs as inputs_compat
from trainer.errors import CorruptCheckpointError, ModelNotReadyError

SERVING_KEY = "serving_default"


def _functional(model: keras.Model) -> bool:
    return isinstance(model, keras.Model) and type(model).__name__ == "Functional"


def input_signature(model: keras.Model) -> list[Any]:
    """``tf.TensorSpec`` structure of the model's inputs, batch dimension left open.

    A Functional model names each input after its ``InputLayer`` (the ``keras.Input``'s
    name, or the one Keras gave its layer: stored in the config, unlike its tensor's
    counter name); Sequential and subclassed models get the shapes they were built with
    and the name ``inputs``.
    """
    if _functional(model) and model.inputs:
        # The inputs' own structure: a dict of inputs stays a dict (as a flat list, the
        # model refused it: "the structure of inputs doesn't match").
        (structure,) = inputs_compat.get_input_signature(model)
        names = inputs_compat.input_layer_names(model) or [t.name for t in model.inputs]
        flat = keras.tree.flatten(structure)
        specs = [
            tf.TensorSpec((None, *tuple(s.shape)[1:]), s.dtype, name=n)
            for s, n in zip(flat, names, strict=True)
        ]
        return [keras.tree.pack_sequence_as(structure, specs)]
    try:
        structure = inputs_compat.get_input_signature(model)
    except (ValueError, TypeError) as error:  # what Keras raises for an unbuilt model
        # A model rebuilt from its config (h5, weights) is built but was never called.
        structure = inputs_compat.recorded_input_signature(model) if model.built else None
        if structure is not None:
            opened = [tf.nest.map_structure(_open_batch, s) for s in structure]
            return declared_dtypes(model, opened)
        raise ModelNotReadyError(
            f"The input signature of model {model.name!r} cannot be determined "
            f"({type(error).__name__}: {error}). Build the model on a batch of data before "
            f"exporting it. Received {type(model).__name__}"
        ) from error

    return declared_dtypes(model, [tf.nest.map_structure(_open_batch, s) for s in structure])


def declared_dtypes(model: keras.Model, structure: Any) -> Any:
    """The structure with the dtypes a subclassed model declares in its ``input_spec``.
    Keras types a subclassed model's inputs with its float compute dtype (it records no
    dtype for its calls), and a model declaring int32 ids then refuses its own serving
    inputs."""
    if keras_compat.is_functional(model) or isinstance(model, keras.Sequential):
        return structure
    flat = tf.nest.flatten(structure)
    declared = tf.nest.flatten(model.input_spec) if model.input_spec is not None else []
    if len(declared) != len(flat) or not all(
        isinstance(d, keras.InputSpec) and d.dtype for d in declared
    ):
        return structure
    typed = [
        tf.TensorSpec(s.shape, tf.as_dtype(d.dtype), name=s.name)
        for s, d in zip(flat, declared, strict=True)
    ]
    return tf.nest.pack_sequence_as(structure, typed)


def _open_batch(spec: Any) -> tf.TensorSpec:
    return tf.TensorSpec((None, *tuple(spec.shape)[1:]), spec.dtype, name="inputs")


def serving_function(model: keras.Model) -> tf.types.experimental.PolymorphicFunction:
    """``tf.function`` running the model in inference mode on one batch; a Functional
    model's outputs are keyed by its output layer names (``logits``), others ``output_0``.
    Names one layer gives two outputs (a shared head) are not keys: a dict would keep one
    of them. A model whose ``call`` takes several positional inputs gets them as such."""
    signature = input_signature(model)
    names = list(getattr(model, "output_names", None) or []) if _functional(model) else []
    if len(set(names)) != len(names):
        names = []

    def serve(*inputs):
        outputs = model(*inputs, training=False)
        flat = tf.nest.flatten(outputs)
        if names and len(names) == len(flat) and not isinstance(outputs, dict):
            return dict(zip(names, flat, strict=True))
        return outputs

    return tf.function(serve, input_signature=signature, autograph=False, reduce_retracing=True)


def describe_specs(structure: Any, *, prefix: str) -> dict[str, dict[str, Any]]:
    """``{name: {"shape": [...], "dtype": "float32"}}`` for a TensorSpec structure; unnamed
    entries get ``<prefix>_<i>`` as a SavedModel signature would."""
    out = {}
    if isinstance(structure, dict):
        items = sorted(structure.items())
    else:
        flat = tf.nest.flatten(structure)
        items = []
        taken: set[str] = set()
        for i, s in enumerate(flat):
            name = s.name if isinstance(s, tf.TensorSpec) and s.name else f"{prefix}_{i}"
            # Made unique as a SavedModel signature makes them: inputs, inputs_1, ...
            unique, k = name, 0
            while unique in taken:
                k += 1
                unique = f"{name}_{k}"
            taken.add(unique)
            items.append((unique, s))
    for name, spec in items:
        out[name] = {"shape": spec.shape.as_list(), "dtype": spec.dtype.name}
    return out


def model_signatures(model: keras.Model) -> dict[str, dict[str, Any]]:
    """The ``serving_default`` signature an export of ``model`` gets (traces the model)."""
    concrete = serving_function(model).get_concrete_function()
    positional = concrete.structured_input_signature[0]
    inputs = positional[0] if len(positional) == 1 else list(positional)
    return {
        SERVING_KEY: {
            "inputs": describe_specs(inputs, prefix="input"),
            "outputs": describe_specs(concrete.structured_outputs, prefix="output"),
        }
    }


def saved_model_signatures(directory: str | Path) -> dict[str, dict[str, Any]]:
    """Signatures of a SavedModel directory, parsed from ``saved_model.pb`` only."""
    pb = Path(directory) / "saved_model.pb"
    proto = saved_model_pb2.SavedModel()
    try:
        proto.ParseFromString(pb.read_bytes())
    except (OSError, Exception) as error:
        raise CorruptCheckpointError(
            f"{pb} cannot be parsed as a SavedModel ({type(error).__name__}: {error}). The "
            f"directory is damaged or not a SavedModel. Received: {str(directory)!r}"
        ) from None
    signatures: dict[str, dict[str, Any]] = {}
    for meta_graph in proto.meta_graphs:
        for key, sig in meta_graph.signature_def.items():
            if key.startswith("__"):  # __saved_model_init_op and friends
                continue
            signatures[key] = {
                "inputs": {n: _tensor_info(t) for n, t in sorted(sig.inputs.items())},
                "outputs": {n: _tensor_info(t) for n, t in sorted(sig.outputs.items())},
            }
    return signatures


def _tensor_info(info: Any) -> dict[str, Any]:
    shape = tf.TensorShape(info.tensor_shape).as_list() if info.HasField("tensor_shape") else None
    return {"shape": shape, "dtype": tf.dtypes.as_dtype(info.dtype).name}


def format_signatures(signatures: dict[str, dict[str, Any]]) -> list[str]:
    """Human-readable lines, e.g. ``serving_default(image: float32[?,8,8,1]) -> ...``."""

    def spec(name: str, info: dict[str, Any]) -> str:
        shape = info["shape"]
        dims = "?" if shape is None else ",".join("?" if d is None else str(d) for d in shape)
        return f"{name}: {info['dtype']}[{dims}]"

    lines = []
    for key, sig in sorted(signatures.items()):
        inputs = ", ".join(spec(n, i) for n, i in sig["inputs"].items())
        outputs = ", ".join(spec(n, i) for n, i in sig["outputs"].items())
        lines.append(f"{key}({inputs}) -> {outputs}")
    return lines
