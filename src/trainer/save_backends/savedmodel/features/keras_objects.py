"""What TensorFlow sees of a Keras variable and a Keras layer, for the save path, the
records and the revived layers alike: the ``tf.Variable`` behind a Keras variable, and
whether a layer's ``call`` takes ``training``."""

from __future__ import annotations

import inspect
from typing import Any

import keras
import tensorflow as tf

from trainer.errors import ModelNotReadyError


def variable_storage(variable: Any) -> tf.Variable | None:
    """The ``tf.Variable`` holding a Keras variable's storage (its public ``value``, which
    on the TensorFlow backend *is* that ``tf.Variable`` outside of Keras' call scopes), a
    ``tf.Variable`` itself, or None if there is no such storage (uninitialized)."""
    if isinstance(variable, keras.Variable):
        value = variable.value
        return value if isinstance(value, tf.Variable) else None
    if isinstance(variable, tf.Variable):
        return variable
    return None


def tf_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` holding a Keras variable's storage."""
    storage = variable_storage(variable)
    if storage is not None:
        return storage
    raise ModelNotReadyError(
        f"Variable {getattr(variable, 'path', variable)!r} has no TensorFlow storage yet "
        f"(uninitialized or not on the TensorFlow backend); build the model first. "
        f"Received {type(variable).__name__}"
    )


def takes_training(layer: keras.layers.Layer) -> bool:
    """Whether the layer's ``call`` accepts ``training``: what Keras itself derives from
    the signature of ``layer.call`` when the layer is made. While tracing replaces ``call``
    on the instance (``CallRecorder``, ``Dispatcher``), the class's ``call`` is inspected."""
    call = type(layer).call if "call" in vars(layer) else layer.call
    return "training" in inspect.signature(call).parameters
