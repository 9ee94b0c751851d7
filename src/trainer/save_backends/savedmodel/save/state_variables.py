"""Variables a layer's calls use that are not among its Keras weights.

``tf.saved_model.save`` refuses a traced function that captures a variable the object
graph does not reach ("untracked resource"); each layer's node therefore also holds these.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.save_backends.savedmodel.features.keras_objects import variable_storage


def state_variables(layer: keras.layers.Layer) -> list[tf.Variable]:
    """Variables a layer's calls read or update that are not among ``layer.variables``:
    those of the ``keras.metrics`` objects it holds (``self.tracker =
    keras.metrics.Mean()`` updated in ``call``), untracked variables it keeps in its own
    attributes (a stateful RNN's ``states``), and for a layer revived from traced functions
    whatever else those functions captured (the loaded ones of the same kinds).
    ``tf.saved_model.save`` refuses a function capturing a variable that the object graph
    does not reach. Keras' own bookkeeping attributes (a model's compiled metrics and loss
    tracker, never touched by ``call``) are left out."""
    candidates: list[Any] = []
    for name, value in list(vars(layer).items()):
        # Plain values are most of a layer's attributes; every save walks them all (the
        # structure fingerprint), so they are passed over before any further check.
        if type(value) in _PLAIN or name in keras_compat.LAYER_STATE_ATTRIBUTES:
            continue
        for item in _flat_attribute(value) if isinstance(value, list | tuple) else (value,):
            if isinstance(item, keras.metrics.Metric):
                candidates.extend(item.variables)
            elif isinstance(item, keras.Variable | tf.Variable):
                candidates.append(item)
    traced = (
        live_objects.TRACED_INFERENCE_CALL,
        live_objects.TRACED_TRAINING_CALL,
        live_objects.TRACED_DEFAULT_CALL,
    )
    for marker in traced:
        function = live_objects.get_marker(layer, marker)
        for concrete in tf_compat.concrete_functions(function) if function is not None else []:
            candidates.extend(concrete.variables)
    if not candidates:
        return []
    weights = {id(variable_storage(v)) for v in layer.variables}
    found: dict[int, tf.Variable] = {}
    for variable in candidates:
        storage = variable_storage(variable)
        if storage is not None and id(storage) not in weights:
            found.setdefault(id(storage), storage)
    return list(found.values())


_PLAIN = (str, int, float, bool, type(None), dict)  # never holds a variable (as before)


def _flat_attribute(value: Any, depth: int = 0) -> list[Any]:
    """An attribute's value, and the items of (nested) lists and tuples it holds."""
    if not isinstance(value, list | tuple) or depth > 3:
        return [value]
    return [item for element in value for item in _flat_attribute(element, depth + 1)]
