"""Input dtypes of the serving signature that Keras' own export gets wrong.

``keras.Model.export`` (whose input signature the SavedModel backend starts from) types a
subclassed model's inputs with its float compute dtype, because Keras records no dtype for
the calls of a subclassed model: a model trained on integer token ids would be served, and
revived, as taking floats. A Sequential model whose layers Keras could not link into a
graph has no ``inputs`` at all. The helpers here find what the model really takes.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer._compat import call_records
from trainer._compat import keras as keras_compat
from trainer.model_state import serving


def _types_unrecorded(model: keras.Model) -> bool:
    """Whether Keras recorded nothing of the dtypes and kinds of the model's inputs: a
    subclassed model without an ``input_spec`` (a Functional or Sequential model has its
    ``keras.Input``s)."""
    graph = keras_compat.is_functional(model) or isinstance(model, keras.Sequential)
    return not graph and model.input_spec is None


def unlinked_sequential_input(model: keras.Model) -> tf.TensorSpec | None:
    """A Sequential model whose layers Keras could not link into a graph (a ``Lambda``
    whose output shape it cannot infer, such as ``tf.strings.lower``) is built but has no
    ``inputs``; its ``Input`` layer still says what it takes."""
    if not isinstance(model, keras.Sequential) or hasattr(model, "inputs"):
        return None  # hasattr: ``inputs`` raises AttributeError when there is no graph
    layers = keras_compat.tracked_sublayers(model)
    if not layers or not isinstance(layers[0], keras.layers.InputLayer):
        return None
    shape = list(layers[0].batch_shape)
    return tf.TensorSpec([None, *shape[1:]], tf.as_dtype(layers[0].dtype))


def declared_dtypes(model: keras.Model, structure: Any) -> Any:
    """The structure with the dtypes a subclassed model declares in its ``input_spec``
    (Keras' export takes the layer's float compute dtype instead, and the model then
    refuses its own serving inputs); the serving function of ``model_state`` reads them
    the same way."""
    return serving.declared_dtypes(model, structure)


_ID_USES = frozenset({"Cast", "NotEqual", "Equal"})


def integer_inputs(model: keras.Model, structure: Any, concrete: Any) -> Any | None:
    """For a subclassed model that declares no input dtypes: if the serving function
    traced with float inputs uses an input only to cast it to an integer type (an
    ``Embedding`` first), the model takes integer ids, and the structure with that integer
    type is returned (None if nothing changes). Keras records no dtype for the calls of a
    subclassed model, and serving ids as floats would make the revived model refuse the
    ids it was trained on. A cast to string (a ``TextVectorization`` or ``StringLookup``
    first) likewise means the model takes strings: TensorFlow cannot even run that cast,
    so the float signature served nothing."""
    if not _types_unrecorded(model):  # typed by its inputs, or as it declares
        return None
    flat = tf.nest.flatten(structure)
    typed = []
    for spec, tensor in zip(flat, concrete.inputs[: len(flat)], strict=True):
        consumers = tensor.consumers() if spec.dtype.is_floating else []
        casts = [op for op in consumers if op.type == "Cast"]
        targets = {op.get_attr("DstT") for op in casts}
        # Besides the casts, only comparisons: the mask of an ``Embedding(mask_zero=True)``
        # compares the ids with 0 before they are cast.
        if casts and len(targets) == 1 and all(op.type in _ID_USES for op in consumers):
            target = tf.as_dtype(targets.pop())
            if target.is_integer or target == tf.string:
                spec = tf.TensorSpec(spec.shape, target, name=spec.name)
        typed.append(spec)
    if all(a.dtype == b.dtype for a, b in zip(flat, typed, strict=True)):
        return None
    return tf.nest.pack_sequence_as(structure, typed)


_OTHER_WIDTH = {tf.int32: tf.int64, tf.int64: tf.int32}


def other_integer_width(structure: Any) -> Any | None:
    """The structure with its int32 inputs as int64 and its int64 inputs as int32 (None if
    it has neither). Ids inferred from the model's own ops get the width those ops cast
    to (an ``Embedding`` int32, a ``one_hot`` or ``IntegerLookup`` int64), which need not
    be the one the model was called with (Keras records no dtype): a revived model then
    takes both, NumPy's default int64 and the int32 of ``keras.Input``/tokenizers."""
    flat = tf.nest.flatten(structure)
    other = [
        tf.TensorSpec(s.shape, _OTHER_WIDTH[s.dtype], name=s.name)
        if isinstance(s, tf.TensorSpec) and s.dtype in _OTHER_WIDTH
        else s
        for s in flat
    ]
    if all(a is b for a, b in zip(flat, other, strict=True)):
        return None
    return tf.nest.pack_sequence_as(structure, other)


def id_candidates(model: keras.Model, structure: Any) -> list[Any]:
    """For a subclassed model that declares no input dtypes and cannot even be traced on
    the float inputs Keras' signature gives it: the structures with one float input as
    int32 ids each, to try in turn. A model gathering rows by its inputs (``ops.take``,
    ``tf.gather``, ``one_hot`` of them) takes integers only, and Keras records no dtype for
    the calls of a subclassed model; one input at a time, so float features beside the
    ids are never served (and truncated) as integers."""
    if not _types_unrecorded(model):
        return []
    flat = tf.nest.flatten(structure)
    candidates = []
    floats = [i for i, s in enumerate(flat) if isinstance(s, tf.TensorSpec) and s.dtype.is_floating]
    for position in floats:
        candidates.append(_as_ids(structure, flat, [position], tf.int32))
    # Then every float input as ids at once: a layer crossing or hashing several id inputs
    # (``HashedCrossing``) takes integers on all of them, and NumPy's int64 first.
    if len(floats) > 1:
        candidates += [_as_ids(structure, flat, floats, d) for d in (tf.int64, tf.int32)]
    return candidates


def _as_ids(structure: Any, flat: list, positions: list[int], dtype: tf.DType) -> Any:
    """``structure`` with the specs at ``positions`` (of ``flat``) typed ``dtype``."""
    changed = [
        tf.TensorSpec(s.shape, dtype, name=s.name) if i in positions else s
        for i, s in enumerate(flat)
    ]
    return tf.nest.pack_sequence_as(structure, changed)


# The integer dtypes a model holding converting layers (``Rescaling``, augmentations) is
# traced on when there is no record of its calls (``call_records``): NumPy's default,
# Keras's and TensorFlow's, then decoded images' uint8 and 16-bit audio samples (Keras's
# own Rescaling test feeds int16). Each costs one more trace of the model and its layers
# on the first save; uint16 and int8 are left out for that cost. With a record, the model
# is traced on int64 and int32 and on the integer dtypes it was called on.
IMAGE_INTEGERS = (tf.int64, tf.int32, tf.uint8, tf.int16)
_ID_WIDTHS = (tf.int64, tf.int32)


def integer_variants(model: keras.Model, structure: Any) -> list[Any]:
    """For a subclassed model that declares no input dtypes: the structure with every
    float input as each integer dtype to try (``IMAGE_INTEGERS``, or NumPy's int64,
    ``keras.Input``'s and TensorFlow's int32 and the integer dtypes the model was called
    on, where ``call_records`` has them) to trace besides the floats Keras' signature
    gives it. Keras records no dtype for the calls of a subclassed model; one called on
    integer images would otherwise be revived taking floats only. Each is kept only where
    the model traces on it (its own code on those dtypes, as a tf.function of the
    original would run)."""
    if not _types_unrecorded(model):
        return []
    flat = tf.nest.flatten(structure)
    if not any(isinstance(s, tf.TensorSpec) and s.dtype.is_floating for s in flat):
        return []
    variants = []
    for dtype in _integers_to_try(model):
        typed = [
            tf.TensorSpec(s.shape, dtype, name=s.name)
            if isinstance(s, tf.TensorSpec) and s.dtype.is_floating
            else s
            for s in flat
        ]
        variants.append(tf.nest.pack_sequence_as(structure, typed))
    return variants


def _integers_to_try(model: keras.Model) -> tuple[tf.DType, ...]:
    record = call_records.recorded(model)
    if record is None:
        return IMAGE_INTEGERS
    seen = sorted(tf.as_dtype(d) for d in record.dtypes if tf.as_dtype(d).is_integer)
    return _ID_WIDTHS + tuple(d for d in seen if d not in _ID_WIDTHS)


def composite_variants(model: keras.Model, structure: Any) -> list[Any]:
    """For a subclassed model that declares no input spec: the structure with every dense
    input as a ``tf.SparseTensorSpec``, then as a ``tf.RaggedTensorSpec`` (same dtype and
    shape), to trace besides the dense specs Keras' signature gives it. Keras records only
    the shapes of a subclassed model's calls, not the kind of tensor it was called on: one
    called on sparse features or ragged rows would otherwise be revived taking dense
    tensors only. Each is kept only where the model traces on it (its own code on such
    tensors, as a tf.function of the original would run). Where ``call_records`` knows
    what the model was called on, only the kinds it saw: each try is a throwaway trace
    of the whole model, and a kept one is traced again for every layer."""
    if not _types_unrecorded(model):
        return []
    flat = tf.nest.flatten(structure)
    if not flat or not all(isinstance(s, tf.TensorSpec) and s.shape.rank for s in flat):
        return []
    record = call_records.recorded(model)
    seen = {"sparse", "ragged"} if record is None else record.kinds
    sparse = [tf.SparseTensorSpec(s.shape, s.dtype) for s in flat]
    ragged = [_ragged_spec(s) for s in flat]
    variants = [sparse] if "sparse" in seen else []
    if "ragged" in seen and all(r is not None for r in ragged):
        variants.append(ragged)
    return [tf.nest.pack_sequence_as(structure, v) for v in variants]


def _ragged_spec(spec: tf.TensorSpec) -> tf.RaggedTensorSpec | None:
    """The ragged spec of a dense one, its ragged dimensions the leading ones of unknown
    size after the batch (as ``tf.ragged.constant`` makes them); None for rank 1."""
    if spec.shape.rank < 2:
        return None
    dims = spec.shape.as_list()[1:]
    rank = max(1, next((i for i, d in enumerate(dims) if d is not None), len(dims)))
    return tf.RaggedTensorSpec(spec.shape, spec.dtype, ragged_rank=rank)


def declared_batch(model: keras.Model, structure: Any) -> Any | None:
    """The structure with the first dimension each ``keras.Input`` of a Functional or
    Sequential model declares (``batch_shape=(h, w, c)``), or a subclassed model was
    built on, for a model that cannot be traced with that dimension free: a layer on one
    unbatched image (``RandomCrop`` on rank 3) needs its static size. None if no input
    declares one. Tried only after the free-batch trace failed, so no model that runs on
    any batch size is narrowed."""
    flat = tf.nest.flatten(structure)
    if keras_compat.is_functional(model) or isinstance(model, keras.Sequential):
        inputs = list(getattr(model, "inputs", None) or [])
    else:  # a subclassed model: the shapes it was built on, first dimension included
        inputs = _built_shapes((model.get_build_config() or {}).get("input_shape"))
    if len(inputs) != len(flat) or not all(isinstance(s, tf.TensorSpec) for s in flat):
        return None
    declared = [tuple(x.shape) for x in inputs]
    if not any(shape and shape[0] is not None for shape in declared):
        return None
    typed = [
        tf.TensorSpec(shape, spec.dtype, name=spec.name) if shape else spec
        for spec, shape in zip(flat, declared, strict=True)
    ]
    return tf.nest.pack_sequence_as(structure, typed)


def _built_shapes(shape: Any) -> list[tf.TensorSpec]:
    """Specs of the shape (or list of shapes) in a subclassed model's build config; none
    for any other structure (a dict of inputs)."""

    def plain(value: Any) -> bool:
        return isinstance(value, tuple | list) and all(
            d is None or isinstance(d, int) for d in value
        )

    if plain(shape):
        return [tf.TensorSpec(tuple(shape))]
    if isinstance(shape, tuple | list) and shape and all(plain(s) for s in shape):
        return [tf.TensorSpec(tuple(s)) for s in shape]
    return []


def composite_inputs(model: keras.Model, structure: Any) -> Any:
    """The structure with a ``tf.RaggedTensorSpec`` / ``tf.SparseTensorSpec`` for every
    ``keras.Input(ragged=True)`` / ``keras.Input(sparse=True)`` of a Functional or
    Sequential model. Keras' export signature is dense only: traced with it, a layer that
    takes ragged rows or sparse features is handed a dense tensor (and fails, or is
    revived taking dense tensors only)."""
    if not (keras_compat.is_functional(model) or isinstance(model, keras.Sequential)):
        return structure
    flat = tf.nest.flatten(structure)
    inputs = list(getattr(model, "inputs", None) or [])
    if len(inputs) != len(flat) or not any(_is_composite(x) for x in inputs):
        return structure
    typed = [
        _composite_spec(spec, tensor) if _is_composite(tensor) else spec
        for spec, tensor in zip(flat, inputs, strict=True)
    ]
    return tf.nest.pack_sequence_as(structure, typed)


def _is_composite(tensor: Any) -> bool:
    return bool(getattr(tensor, "sparse", False) or getattr(tensor, "ragged", False))


def _composite_spec(spec: tf.TensorSpec, tensor: Any) -> tf.TypeSpec:
    if getattr(tensor, "sparse", False):
        return tf.SparseTensorSpec(spec.shape, spec.dtype)
    # Ragged dimensions follow the batch dimension; unless the Input says how many, every
    # leading dimension of unknown size is one (as tf.ragged.constant makes them).
    rank = getattr(tensor, "ragged_rank", None)
    if rank is None:
        dims = spec.shape.as_list()[1:]
        rank = max(1, next((i for i, d in enumerate(dims) if d is not None), len(dims)))
    splits = getattr(tensor, "row_splits_dtype", None) or "int64"
    return tf.RaggedTensorSpec(spec.shape, spec.dtype, ragged_rank=rank, row_splits_dtype=splits)
