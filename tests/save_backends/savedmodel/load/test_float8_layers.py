"""Issue 42, item 5: float8-quantized ``Dense`` / ``EinsumDense`` through savedmodel.

``model.quantize("float8")`` adds six scale and amax-history variables to a layer after
its kernel and bias; the layer Keras rebuilds from the float8 config creates them first.
The loader bound a rebuilt layer's variables by position, so the save refused such a model
(before that, the load called the checkpoint damaged). Now a rebuilt layer's variables are
bound by name (``records.rebuilt_order``): the model comes back as Keras's own float8
layers with every variable, serves, and trains on as the original does. A float8 layer
inside a layer that creates its sublayers itself (a custom block, a subclassed model) was
refused at save time: a load from its holder's class rebuilds it unquantized. Its holder
is revived from its traces instead, whose float8 ops take their gradient from Python: the
SavedModel holds those gradient functions now (``features.python_gradients``), and the
holder trains as the original does, scales and amax histories included.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.savedmodel_zoo import classes_hidden
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


PKG = "test_float8_layers"


@keras.saving.register_keras_serializable(package=PKG)
class Block(keras.layers.Layer):
    """Creates its Dense itself (rebuilt from its config, the Dense would not be
    quantized), and its ``call`` does not declare ``training``: Keras hands it on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(4, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return self.inner(x) * 2.0


@keras.saving.register_keras_serializable(package=PKG)
class Net(keras.Model):
    """A subclassed model holding float8 layers. Its ``call`` declares ``training``: Keras's
    ``fit`` passes it only to such a model, and float8 layers move their scales only then."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(8, name="first")
        self.second = keras.layers.EinsumDense("ab,bc->ac", output_shape=2, name="second")

    def call(self, x, training=None):
        return self.second(tf.nn.relu(self.first(x, training=training)), training=training)


def _held_by_block() -> keras.Model:
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(Block(name="block")(inputs)))


def _held_by_net() -> keras.Model:
    model = Net()
    model(np.zeros((1, 6), "float32"))
    return model


@pytest.fixture(scope="module", params=[_held_by_block, _held_by_net], ids=["block", "subclassed"])
def held(request, tmp_path_factory):
    """Issue 42 item 5: a float8 layer held by a layer that creates its sublayers itself
    was refused at save. Its holder is revived from its traces (a load from its class
    would build the sublayer unquantized); their float8 ops take their gradient from
    Python, which the SavedModel now holds (``features.python_gradients``)."""
    keras.utils.set_random_seed(2)
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")
    model = request.param()
    model.quantize("float8")
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("held") / "ckpt")
    return model, path, x, y


@pytest.mark.parametrize("hidden", [True, False], ids=["class_hidden", "class_known"])
def test_float8_layers_held_by_custom_layers_train_like_the_original(held, hidden):
    """Every variable, the scales and amax histories the optimizer overwrites included,
    equal after two epochs; before, a revived holder's trace left ``training`` unresolved
    for the float8 layers (no scale moved: "Gradients do not exist") or was refused."""
    model, path, x, y = held
    names = ["Block", "Net"] if hidden else []
    with classes_hidden(names, PKG):
        loaded = get_backend("savedmodel").load(path).model
    original = by_path(model)
    optimizer = [v.numpy() for v in model.optimizer.variables]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    float8 = [v for v in loaded.weights if v.name in FLOAT8_VARIABLES]
    assert len(float8) == 12, [v.path for v in loaded.weights]
    try:
        loaded.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        mine, theirs = by_path(model), by_path(loaded)
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            np.testing.assert_allclose(theirs[key], value, rtol=1e-6, err_msg=key)
        moved = [k for k in mine if k.endswith("kernel_amax_history")]
        assert moved and all(np.any(mine[k] != original[k]) for k in moved)
    finally:  # the next test of this module-scoped model starts from the saved state
        for variable in model.weights:
            variable.assign(original[variable.path])
        for variable, value in zip(model.optimizer.variables, optimizer, strict=True):
            variable.assign(value)


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
