"""A layer built on a ``tf.Tensor``'s shape records a ``tf.TensorShape`` in its build
config (``Normalization.adapt(tf.constant(x))``, ``layer.build(x.shape)``). The savedmodel
record could not hold it as JSON and kept no build config; every load then failed with a
``MissingClassError`` telling the user to register Keras's own class."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel import records


@pytest.mark.parametrize("layer_kind", ["normalization", "dense_built_on_tensor_shape"])
def test_a_layer_built_on_a_tensor_shape_loads_exactly(tmp_path, layer_kind):
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    if layer_kind == "normalization":
        layer = keras.layers.Normalization()
        layer.adapt(tf.constant(x))
    else:
        layer = keras.layers.Dense(4)
        layer.build(tf.constant(x).shape)
    assert isinstance(layer.get_build_config()["input_shape"], tf.TensorShape)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(2)(layer(inputs)))
    model.compile("adam", "mse")
    backend = get_backend("savedmodel")
    loaded = backend.load(backend.save(model, tmp_path / "ckpt")).model
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_plain_shapes_converts_nested_tensor_shapes():
    value = {"a": tf.TensorShape([None, 3]), "b": [tf.TensorShape(None), (1, 2)], "c": 4}
    assert records.plain_shapes(value) == {"a": [None, 3], "b": [None, (1, 2)], "c": 4}
