"""Ragged and sparse model inputs at the ``serving_default`` signature.

Why components: a SavedModel *signature* (what TF Serving, ``saved_model_cli`` and
``TFSMLayer`` call) takes dense tensors only, while the model takes a ``tf.RaggedTensor``
or ``tf.SparseTensor``. Leaving the signature out would make such a checkpoint unservable;
dense-padding the input would change what ragged-aware layers compute. So the signature
takes each composite input as its components, named after the input, and reassembles it
(validated) before calling ``serve``, which itself takes the composite tensor as the model
does:

- ragged ``x``: ``x_values`` (its flat values) and ``x_row_splits`` (``x_row_splits_<k>``
  for each ragged dimension ``k`` when there are several), as ``tf.RaggedTensor`` gives
  them (``.flat_values``, ``.nested_row_splits``);
- sparse ``x``: ``x_indices``, ``x_values``, ``x_dense_shape`` (``tf.SparseTensor``'s own).

The metadata's signature lists these components as its inputs and names, under
``composite_inputs``, which input each belongs to.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

COMPOSITE_SPECS = (tf.RaggedTensorSpec, tf.SparseTensorSpec)


def is_composite(spec: Any) -> bool:
    return isinstance(spec, COMPOSITE_SPECS)


def components(spec: Any, name: str) -> list[tf.TensorSpec]:
    """The dense signature inputs standing for one model input (itself if dense)."""
    if isinstance(spec, tf.SparseTensorSpec):
        rank = spec.shape.rank
        return [
            tf.TensorSpec([None, rank], tf.int64, name=f"{name}_indices"),
            tf.TensorSpec([None], spec.dtype, name=f"{name}_values"),
            tf.TensorSpec([rank], tf.int64, name=f"{name}_dense_shape"),
        ]
    if isinstance(spec, tf.RaggedTensorSpec):
        ragged_rank = spec.ragged_rank
        inner = spec.shape[ragged_rank + 1 :] if spec.shape.rank is not None else None
        values_shape = [None, *inner] if inner is not None else None
        splits = [
            tf.TensorSpec(
                [None],
                spec.row_splits_dtype,
                name=f"{name}_row_splits" + (f"_{k}" if ragged_rank > 1 else ""),
            )
            for k in range(ragged_rank)
        ]
        return [tf.TensorSpec(values_shape, spec.dtype, name=f"{name}_values"), *splits]
    return [spec]


def assemble(spec: Any, tensors: list[Any]) -> Any:
    """The model input rebuilt from its signature components (checked: malformed row
    splits or indices fail the request instead of reading out of bounds)."""
    if isinstance(spec, tf.SparseTensorSpec):
        indices, values, dense_shape = tensors
        return tf.SparseTensor(indices, values, dense_shape)
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensor.from_nested_row_splits(tensors[0], tensors[1:], validate=True)
    return tensors[0]


def describe(spec: Any, name: str) -> dict[str, Any] | None:
    """Metadata entry of a composite input (None for a dense one)."""
    if not is_composite(spec):
        return None
    entry: dict[str, Any] = {
        "name": name,
        "kind": "sparse" if isinstance(spec, tf.SparseTensorSpec) else "ragged",
        "shape": spec.shape.as_list() if spec.shape.rank is not None else None,
        "dtype": spec.dtype.name,
        "components": [c.name for c in components(spec, name)],
    }
    if isinstance(spec, tf.RaggedTensorSpec):
        entry["ragged_rank"] = spec.ragged_rank
        entry["row_splits_dtype"] = spec.row_splits_dtype.name
    return entry


def unflatten(structure: Any, flat_components: list[Any]) -> Any:
    """``structure`` (of specs) with each leaf replaced by its input rebuilt from the
    next of ``flat_components``, in the order ``components`` lists them."""
    leaves, position = [], 0
    for spec in tf.nest.flatten(structure):
        count = len(components(spec, "x"))
        leaves.append(assemble(spec, list(flat_components[position : position + count])))
        position += count
    return tf.nest.pack_sequence_as(structure, leaves)
