"""Issue 42, item 5: float8-quantized ``Dense`` / ``EinsumDense`` through savedmodel.

``model.quantize("float8")`` adds six scale and amax-history variables to a layer after
its kernel and bias; the layer Keras rebuilds from the float8 config creates them first.
The loader bound a rebuilt layer's variables by position, so the save refused such a model
(before that, the load called the checkpoint damaged). Now a rebuilt layer's variables are
bound by name (``records.rebuilt_order``): the model comes back as Keras's own float8
layers with every variable, serves, and trains on as the original does. A float8 layer
inside a layer that creates its sublayers itself is still refused at save time: a load
rebuilds it unquantized (``save/float8.py``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.records import rebuilt_order

FLOAT8_VARIABLES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


def by_path(model: keras.Model) -> dict[str, np.ndarray]:
    """Every variable by its path: the rebuilt layers list them in another order."""
    return {v.path: np.asarray(v) for v in model.weights}


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    keras.utils.set_random_seed(5)
    x = np.random.default_rng(5).normal(size=(16, 12)).astype("float32")
    y = np.random.default_rng(6).normal(size=(16, 4)).astype("float32")
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu", name="d1")(inputs)
    hidden = keras.layers.EinsumDense("ab,bc->ac", output_shape=8, bias_axes="c", name="e1")(hidden)
    outputs = keras.layers.Dense(4, name="d2")(hidden)
    model = keras.Model(inputs, outputs)
    model.quantize("float8")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # scales move
    expected = model.predict(x, verbose=0)
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("f8") / "ckpt")
    loaded = get_backend("savedmodel").load(path).model
    return model, loaded, path, x, y, expected


def test_float8_layers_come_back_as_keras_float8_layers(round_trip):
    _, loaded, *_ = round_trip
    for name, cls in (("d1", keras.layers.Dense), ("e1", keras.layers.EinsumDense)):
        layer = loaded.get_layer(name)
        assert type(layer) is cls, type(layer)
        assert layer.quantization_mode == "float8"
        assert {v.name for v in layer.weights} >= set(FLOAT8_VARIABLES)


def test_outputs_and_every_variable_equal(round_trip):
    model, loaded, _, x, _, expected = round_trip
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    mine, theirs = by_path(model), by_path(loaded)
    assert mine.keys() == theirs.keys()
    assert "e1/kernel_amax_history" in mine
    for key, value in mine.items():
        np.testing.assert_array_equal(theirs[key], value, err_msg=key)
    assert np.any(mine["d1/inputs_amax_history"] != 0)  # training filled the histories


def test_the_checkpoint_serves_the_same_outputs(round_trip):
    _, _, path, x, _, expected = round_trip
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    (result,) = served(tf.constant(x)).values()
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_one_training_step_equal(round_trip):
    model, loaded, _, x, y, _ = round_trip
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for each in (model, loaded):
        each.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0, shuffle=False)
    mine, theirs = by_path(model), by_path(loaded)
    for key, value in mine.items():
        np.testing.assert_array_equal(theirs[key], value, err_msg=key)
    ours = {v.path: np.asarray(v) for v in model.optimizer.variables}
    revived = {v.path: np.asarray(v) for v in loaded.optimizer.variables}
    assert ours.keys() == revived.keys()
    for key, value in ours.items():
        np.testing.assert_array_equal(revived[key], value, err_msg=key)


@keras.saving.register_keras_serializable(package="test_float8_layers")
class Block(keras.layers.Layer):
    """Creates its Dense itself: rebuilt from its config, the Dense is not quantized."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x) * 2.0


def test_float8_layer_inside_a_custom_layer_is_refused_at_save(tmp_path):
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(Block(name="block")(inputs)))
    model.quantize("float8")
    with pytest.raises(ModelNotReadyError, match=r"'inner' in 'block' \(Block\)"):
        get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert not any(tmp_path.iterdir())


def test_rebuilt_order_by_name_then_by_path_else_none():
    live = [("kernel", "d/kernel"), ("bias", "d/bias"), ("scale", "d/scale")]
    rebuilt = [("scale", "d/scale"), ("kernel", "d/kernel"), ("bias", "d/bias")]
    assert rebuilt_order(rebuilt, live) == [2, 0, 1]
    # a model's variables repeat names across layers: their paths tell them apart
    model_live = [("kernel", "a/kernel"), ("kernel", "b/kernel")]
    assert rebuilt_order(model_live[::-1], model_live) == [1, 0]
    # paths repeating too, or other names: position it is
    assert rebuilt_order([("k", "x"), ("k", "x")], [("k", "x"), ("k", "x")]) is None
    assert rebuilt_order([("kernel", "d/kernel")], [("w", "d/w")]) is None
