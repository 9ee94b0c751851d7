"""Keras masks attached to the tensors a layer's ``call`` receives, as inputs of its traces.

Why: Keras hands a mask on by attaching it to the tensor (``_keras_mask``), not only through
a ``mask`` argument. A layer whose ``call`` takes two tensors never receives ``mask``, and
layers read the masks of their inputs themselves: ``MultiHeadAttention`` masks its query and
value with them, keras-hub's encoders merge them with their padding mask. A function traced
on bare placeholders ignores those masks, and a layer revived from it would attend to the
padding, silently. So a call whose tensors carried masks is also traced with those masks,
passed as one more keyword argument (``KEY``) that the traced function attaches back to its
inputs before calling the layer; whoever calls a traced function (the dispatcher while
saving, a revived layer) passes the masks of the tensors it is given, if that function was
traced with them. Every such layer is also traced without ``KEY``, for unmasked callers.
Likewise the masks a layer's outputs carry after its call are returned with them and
attached again by the caller.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import tensorflow as tf_compat

KEY = "__trainer_keras_masks__"


def _mask_of(value: Any) -> Any:
    if isinstance(value, tf.Tensor | tf.Variable) or keras.ops.is_tensor(value):
        return keras_compat.keras_mask(value)
    return None


def masks_of(args: Any, kwargs: dict[str, Any]) -> Any:
    """``(masks of args, masks of kwargs)`` with ``None`` where a value carries no mask, or
    ``None`` if no tensor carries one."""
    structure = (tuple(args), {k: v for k, v in kwargs.items() if k != KEY})
    masks = tf.nest.map_structure(_mask_of, structure)
    return masks if any(m is not None for m in tf.nest.flatten(masks)) else None


def with_masks(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus ``KEY`` holding the masks of the tensors, if any carries one."""
    masks = masks_of(args, kwargs)
    return kwargs if masks is None else {**kwargs, KEY: masks}


def spec_variants(args_spec: Any, kwargs_spec: dict[str, Any], args: Any, kwargs: Any):
    """The call specs to trace for one recorded call: as recorded; with the masks its live
    tensors carried under ``KEY``; and if it received a ``mask`` argument, unmasked (no
    ``mask``, no ``KEY``), as Keras calls it on tensors without masks: a Functional graph
    rebuilt around the layer calls it so, its config holding ``mask=None``."""
    variants = [(args_spec, kwargs_spec)]
    masks = masks_of(args, kwargs)
    if masks is not None:
        specs = tf.nest.map_structure(
            lambda m: None if m is None else tf.TensorSpec(m.shape, m.dtype), masks
        )
        variants.append((args_spec, {**kwargs_spec, KEY: specs}))
    given = kwargs_spec.get("mask")
    if any(m is not None for m in tf.nest.flatten(given)):
        unmasked = tf.nest.map_structure(lambda _: None, given)
        variants.append((args_spec, {**kwargs_spec, "mask": unmasked}))
    return variants


def attach(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Inside a traced function: attach the masks passed under ``KEY`` to the tensors
    they belong to; returns ``kwargs`` without ``KEY``."""
    kwargs = dict(kwargs)
    if KEY not in kwargs:
        return kwargs
    masks = kwargs.pop(KEY)
    structure = (tuple(args), kwargs)
    for value, mask in zip(tf.nest.flatten(structure), tf.nest.flatten(masks), strict=True):
        if mask is not None:
            keras_compat.set_keras_mask(value, mask)
    return kwargs


def returned(outputs: Any, losses: Any) -> tuple[Any, ...]:
    """What a traced call returns: ``(outputs, losses)``, plus the masks Keras attached to
    the outputs if any carries one. A mask a layer sets in its own ``call`` (keras-hub's
    ``TokenAndPositionEmbedding``) or computes after it would otherwise not leave the
    function: tensor attributes do not cross a ``tf.function`` boundary."""
    output_masks = tf.nest.map_structure(_mask_of, outputs)
    if any(m is not None for m in tf.nest.flatten(output_masks)):
        return outputs, losses, output_masks
    return outputs, losses


def received(result: tuple[Any, ...]) -> tuple[Any, Any]:
    """``(outputs, losses)`` of a traced call's result, with the output masks it returned
    attached to the outputs again (as the original layer's outputs carried them)."""
    outputs, losses, *rest = result
    if rest:
        for value, mask in zip(tf.nest.flatten(outputs), tf.nest.flatten(rest[0]), strict=True):
            if mask is not None:
                keras_compat.set_keras_mask(value, mask)
    return outputs, losses


def accepts_masks(function: Any) -> bool:
    """Whether ``function(args, kwargs)`` was traced with masks under ``KEY`` (functions
    saved before masks were recorded never were)."""
    if function is None:
        return False
    for concrete in tf_compat.concrete_functions(function):
        signature = concrete.structured_input_signature[0]
        if len(signature) > 1 and isinstance(signature[1], dict) and KEY in signature[1]:
            return True
    return False
