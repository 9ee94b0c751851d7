"""Keras internals of a model's inputs that trainer needs for serving signatures and
rebuilds, and Keras 3 exposes no public API for: the input signature Keras recorded, the
input layers' names, the shapes a layer was built with.

Same rules as ``trainer._compat.keras``: each helper names the private attribute it uses,
why no public API does the job, and the version it was checked against (Keras 3.15.1,
TensorFlow backend); ``tests/_compat/test_canaries.py`` checks them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf


def get_input_signature(model: keras.Model) -> Any:
    """The input signature ``model.export`` uses: a list (one entry per positional
    argument) of nested ``keras.InputSpec``/``tf.TensorSpec`` structures.

    Uses ``keras.src.export.export_utils.get_input_signature``; ``model.export`` computes
    it but no public API returns it. Raises what it raises (``ValueError`` when the model
    is not built, ``TypeError`` when it is not a model). Checked: Keras 3.15.1.
    """
    from keras.src.export import export_utils

    with _plain_build_shapes(model):
        return export_utils.get_input_signature(model)


def input_layer_names(model: keras.Model) -> list[str] | None:
    """The names of the ``InputLayer``s behind ``model.inputs`` (a Functional or Sequential
    model), in that order; None if some input has none.

    The input tensors' own names are Keras's global counter (``keras_tensor_47``) unless the
    ``Input`` was named: another in every process and every rebuild. The layers' names are
    stored in the config and come back with it. Reads ``KerasTensor._keras_history`` (the
    operation that made the tensor): no public API maps an input tensor to its layer.
    Checked: Keras 3.15.1.
    """
    names = []
    for tensor in getattr(model, "inputs", None) or []:
        history = getattr(tensor, "_keras_history", None)
        operation = getattr(history, "operation", None)
        if not isinstance(getattr(operation, "name", None), str):
            return None
        names.append(operation.name)
    return names or None


def recorded_input_signature(model: keras.Model) -> Any:
    """What ``get_input_signature`` returns for a subclassed model, from the shapes Keras
    recorded when it was built, even if it was never called: a model rebuilt from its
    config (``build_from_config``) has those shapes but no call, and Keras's check of
    ``_called`` refuses it. None where no shapes were recorded.

    Uses ``keras.src.export.export_utils._infer_input_signature_from_model``, the function
    ``get_input_signature`` itself uses after that check (shapes, and the model's input
    dtype, as Keras's own export assumes). Checked: Keras 3.15.1.
    """
    from keras.src.export import export_utils

    with _plain_build_shapes(model):
        return export_utils._infer_input_signature_from_model(model) or None


def plain_shapes(value: Any) -> Any:
    """``value`` with each ``tf.TensorShape`` in it as the list Keras itself records
    (``None`` for an unknown rank). A layer built on a ``tf.Tensor``'s shape (``adapt`` on
    a ``tf.constant``, ``build(x.shape)``, ``build(tf.TensorShape(...))``) records a
    ``TensorShape``, which JSON cannot hold and Keras's export refuses."""
    if isinstance(value, tf.TensorShape):
        return value.as_list() if value.rank is not None else None
    if isinstance(value, dict):
        return {k: plain_shapes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain_shapes(v) for v in value)
    return value


@contextlib.contextmanager
def _plain_build_shapes(model: keras.Model) -> Iterator[None]:
    """Within the block, the shapes the model's build recorded (``_build_shapes_dict``,
    which Keras's export reads) hold lists where they held ``tf.TensorShape``s: Keras's
    export raises a raw ``ValueError`` on a ``TensorShape`` (a subclassed model built with
    ``model.build(tf.TensorShape([None, 8]))``). Put back afterwards: the model is the
    user's. Checked: Keras 3.15.1."""
    recorded = getattr(model, "_build_shapes_dict", None)
    if not recorded:
        yield
        return
    model._build_shapes_dict = plain_shapes(recorded)
    try:
        yield
    finally:
        model._build_shapes_dict = recorded


def make_tf_tensor_spec(spec: Any, *, dynamic_batch: bool = False) -> tf.TensorSpec:
    """``tf.TensorSpec`` of an entry of ``get_input_signature`` (batch dimension free if
    ``dynamic_batch``), the conversion ``model.export`` applies.

    Uses ``keras.src.export.export_utils.make_tf_tensor_spec``; not public.
    Checked: Keras 3.15.1.
    """
    from keras.src.export import export_utils

    return export_utils.make_tf_tensor_spec(spec, dynamic_batch=dynamic_batch)
