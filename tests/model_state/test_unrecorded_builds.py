"""Subclassed models whose build Keras did not record, or recorded in a form it cannot
serialize: each backend saves a checkpoint that loads exactly, or refuses at save time."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.errors import ModelNotReadyError
from trainer.model_state import layer_protocol
from trainer.save_backends import get_backend

PKG = "test_unrecorded_builds"
BACKENDS = ("savedmodel", "h5", "weights")
X = np.random.default_rng(0).random((2, 3, 5)).astype("float32")


@keras.saving.register_keras_serializable(PKG)
class StatefulNet(keras.Model):
    """No build() of its own: Keras cannot build it symbolically (the stateful LSTM's
    states are made from values), so its first eager call builds it unrecorded."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lstm = keras.layers.LSTM(4, stateful=True)
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.lstm(x))


@keras.saving.register_keras_serializable(PKG)
class BuiltStatefulNet(StatefulNet):
    """The remedy the refusal names: a build() that builds its layers."""

    def build(self, input_shape):
        self.lstm.build(input_shape)
        self.head.build((input_shape[0], 4))


@keras.saving.register_keras_serializable(PKG)
class BuiltInInit(keras.Model):
    """Built by its constructor, no build config: a rebuild from its config is built."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)
        self.dense.build((None, 5))
        self.built = True

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_built_by_its_first_call_is_refused_at_save(backend, tmp_path):
    model = StatefulNet()
    model(X)
    assert model.built and model.get_build_config() is None
    with pytest.raises(ModelNotReadyError) as info:
        get_backend(backend).save(model, tmp_path / "ckpt")
    message = str(info.value)
    assert "recorded no input shape" in message and "never called" not in message
    assert "Define build(self, input_shape) on StatefulNet" in message
    assert message.endswith("Received: StatefulNet, built=True, get_build_config()=None")
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_explicit_build_that_a_load_cannot_repeat_is_refused(backend, tmp_path):
    """model.build(shape) after the call records a build config, but a load's symbolic
    build still cannot create the LSTM's states: the save used to succeed and every load
    failed."""
    model = StatefulNet()
    model(X)
    model.build((2, 3, 5))
    with pytest.raises(ModelNotReadyError, match=r"cannot create the states .* Received: "):
        get_backend(backend).save(model, tmp_path / "ckpt")


@pytest.mark.parametrize("backend", BACKENDS)
def test_stateful_model_with_its_own_build_round_trips(backend, tmp_path):
    keras.utils.set_random_seed(3)
    model = BuiltStatefulNet()
    model(X)
    model(X)  # states far from zero
    backend_ = get_backend(backend)
    loaded = backend_.load(backend_.save(model, tmp_path / "ckpt")).model
    for before, after in zip(
        layer_protocol.rnn_states(model.lstm), layer_protocol.rnn_states(loaded.lstm), strict=True
    ):
        np.testing.assert_array_equal(after.numpy(), before.numpy())
    for before, after in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(after.numpy(), before.numpy())
    np.testing.assert_array_equal(loaded(X).numpy(), model(X).numpy())


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_model_built_by_its_constructor_still_saves(backend, tmp_path):
    """No build config either, but its rebuild from config is built: not refused."""
    model = BuiltInInit()
    x = X[:, 0]
    expected = model(x).numpy()
    backend_ = get_backend(backend)
    loaded = backend_.load(backend_.save(model, tmp_path / "ckpt")).model
    np.testing.assert_array_equal(loaded(x).numpy(), expected)


@keras.saving.register_keras_serializable(PKG)
class ShapeBuilt(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_built_with_a_tensor_shape_round_trips(backend, tmp_path):
    """model.build(tf.TensorShape(...)) records a TensorShape, which Keras's export
    refused with a raw ValueError (savedmodel); every backend now saves and loads it."""
    model = ShapeBuilt()
    model.build(tf.TensorShape([None, 8]))
    x = np.random.default_rng(1).random((4, 8)).astype("float32")
    backend_ = get_backend(backend)
    path = backend_.save(model, tmp_path / "ckpt")
    loaded = backend_.load(path).model
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())
    assert isinstance(model.get_build_config()["input_shape"], tf.TensorShape)  # untouched
    if backend == "savedmodel":
        serve = tf.saved_model.load(str(path)).signatures["serving_default"]
        (served,) = serve(tf.constant(x)).values()
        np.testing.assert_allclose(served.numpy(), model(x).numpy(), atol=1e-6)
