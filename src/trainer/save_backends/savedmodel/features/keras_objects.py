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
    return "training" in _call_parameters(layer)


def training_default(layer: keras.layers.Layer) -> Any:
    """The default of ``training`` in the layer's ``call`` (``inspect.Parameter.empty``
    when it has none or takes no ``training``): what Keras passes a layer called with
    ``training`` unresolved (no argument, no outer call deciding it)."""
    parameter = _call_parameters(layer).get("training")
    return inspect.Parameter.empty if parameter is None else parameter.default


def input_spec_from_record(saved: Any) -> Any:
    """The ``input_spec`` a layer's record holds (``records.input_spec_config``: a list of
    InputSpec configs), as a layer revived without its class gets it back: its calls are
    then checked as the original's were, and a re-save types its inputs alike. One spec
    is given back as one; an entry that is not a valid config (untrusted) gives None."""
    if not isinstance(saved, list) or not saved:
        return None
    specs = []
    for config in saved:
        if config is None:
            specs.append(None)
            continue
        try:
            specs.append(keras.layers.InputSpec.from_config(dict(config)))
        except (TypeError, ValueError, AttributeError):
            return None
    return specs[0] if len(specs) == 1 else specs


def _call_parameters(layer: keras.layers.Layer) -> Any:
    """The parameters of the layer's ``call``: the class's while tracing replaces ``call``
    on the instance (``CallRecorder``, ``Dispatcher``)."""
    call = type(layer).call if "call" in vars(layer) else layer.call
    return inspect.signature(call).parameters
