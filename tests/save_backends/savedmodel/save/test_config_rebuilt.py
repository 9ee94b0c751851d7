"""Issue 17 (first save): Keras' own layers that every load rebuilds from their config get
no traced call functions of their own (``savedmodel/config_rebuilt.py``).

What must hold: a layer left untraced is one that a load can always rebuild from its config
(Keras' own class, Keras' own objects in its config, the same variables after
``build_from_config``); every other layer keeps its traces; a custom parent revived from
its traces still infers and trains like the original, with its Keras sublayers' ops
inline; and the check leaves no trace of its own in the process (Python's random state,
Keras' automatic names). Also: a block of Keras layers whose ``call`` ignores ``training``
(``Dense`` declares it and never reads it) gets one trace, not two identical ones.
"""

from __future__ import annotations

import random

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from tests.helpers.savedmodel_zoo import assert_trains_alike, classes_hidden
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel import layout

PKG = "config_rebuilt"


@keras.saving.register_keras_serializable(PKG)
def doubled_relu(x):
    return keras.ops.relu(x) * 2.0


@keras.saving.register_keras_serializable(PKG)
class Block(layers.Layer):
    """A custom block of Keras layers: Dense, BatchNormalization, Dropout."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = layers.Dense(units, activation="relu", name="inner")
        self.norm = layers.BatchNormalization(momentum=0.5, name="norm")
        self.drop = layers.Dropout(0.5, seed=3, name="drop")

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build((*input_shape[:-1], self.units))

    def call(self, x, training=None):
        return self.drop(self.norm(self.dense(x), training=training), training=training)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _model():
    inputs = keras.Input((6,))
    x = layers.Dense(4, name="stem")(inputs)
    x = Block(4, name="block")(x)
    x = layers.Dense(3, activation=doubled_relu, name="custom_act")(x)
    return keras.Model(inputs, layers.Dense(1, name="head")(x), name="net")


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")


def _trained(model):
    x, y = _data()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    return model


def _records(path):
    return {r["name"]: r for r in layout.read_metadata(path)["savedmodel"]["layers"]}


def test_only_layers_a_load_rebuilds_from_config_go_untraced(tmp_path):
    model = _trained(_model())
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    records = _records(path)
    for name in ("stem", "head", "inner", "norm", "drop"):  # Keras' own, Keras' own config
        assert "call_infer" not in records[name]["functions"], name
    # its activation is the user's: where that function is missing the layer needs traces
    assert "call_infer" in records["custom_act"]["functions"]
    assert {"call_infer", "call_train"} <= set(records["block"]["functions"])
    loaded = tf.saved_model.load(str(path))
    assert not hasattr(loaded.layer_nodes[records["inner"]["id"]], "call_infer")
    x, _ = _data()
    served = loaded.signatures["serving_default"]
    (output,) = served(**{served.structured_input_signature[1].popitem()[0]: x}).values()
    np.testing.assert_allclose(output.numpy(), model(x, training=False).numpy(), atol=1e-6)


def test_a_custom_parent_revived_from_traces_holds_its_keras_layers_inline(tmp_path):
    model = _trained(_model())
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    known = get_backend("savedmodel").load(path).model
    with classes_hidden(["Block", "doubled_relu"], PKG):
        checkpoint = get_backend("savedmodel").load(path)
    revived = checkpoint.model
    how = checkpoint.metadata["revived_from"]
    assert how["block"] == "traced" and how["custom_act"] == "traced"
    assert how["inner"] == "config" and how["head"] == "config"
    x, y = _data()
    for training in (False, True):  # Dropout's seeded mask and the batch statistics too
        np.testing.assert_allclose(
            revived(x, training=training).numpy(),
            known(x, training=training).numpy(),
            atol=1e-5,
            err_msg=f"training={training}",
        )
    assert_trains_alike(known, revived, x, y)


def test_a_keras_layer_whose_build_config_does_not_rebuild_it_keeps_its_traces(tmp_path):
    """Without a build config, rebuilding from config leaves the layer without variables:
    the loader builds it by a call on its traced input specs, so it keeps them."""
    model = _trained(_model())
    head = model.get_layer("head")
    object.__setattr__(head, "get_build_config", lambda: None)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    records = _records(path)
    assert records["head"]["build_config"] is None
    assert "call_infer" in records["head"]["functions"]
    assert "call_infer" not in records["stem"]["functions"]
    x, _ = _data()
    loaded = get_backend("savedmodel").load(path).model
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


def test_the_check_leaves_random_state_and_automatic_names_as_they_were(tmp_path):
    """Rebuilding a Dropout (its SeedGenerator) and seedless initializers draws default
    seeds from Python's random module and advances Keras' name counters: a save must not
    change what the user's code draws or names next."""
    inputs = keras.Input((6,))
    x = layers.Dense(4, kernel_initializer=keras.initializers.RandomNormal())(inputs)
    model = keras.Model(inputs, layers.Dropout(0.5)(x))
    model(np.zeros((2, 6), "float32"))
    random.seed(7)
    state = random.getstate()
    before = keras.random.SeedGenerator(1).name  # seed_generator_<n>
    get_backend("savedmodel").save(model, tmp_path / "ckpt")
    after = keras.random.SeedGenerator(1).name
    assert random.getstate() == state
    prefix, number = before.rsplit("_", 1) if before[-1].isdigit() else (before, "0")
    assert after == f"{prefix}_{int(number) + 1}", (before, after)


@keras.saving.register_keras_serializable(PKG)
class DenseOnly(layers.Layer):
    """Two Keras Dense layers: ``Dense.call`` takes ``training`` but never reads it."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.first = layers.Dense(units, activation="relu")
        self.second = layers.Dense(units)

    def build(self, input_shape):
        self.first.build(input_shape)
        self.second.build((*input_shape[:-1], self.units))

    def call(self, x):
        return x[..., : self.units] + self.second(self.first(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_a_block_whose_keras_layers_ignore_training_gets_one_trace(tmp_path):
    inputs = keras.Input((6,))
    x = DenseOnly(4, name="plain")(inputs)
    x = Block(4, name="block")(x)  # its Dropout and BatchNormalization read ``training``
    model = _trained(keras.Model(inputs, layers.Dense(1, name="head")(x)))
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    records = _records(path)
    assert set(records["plain"]["functions"]) == {"call_infer"}
    assert {"call_infer", "call_train"} <= set(records["block"]["functions"])
    known = get_backend("savedmodel").load(path).model
    with classes_hidden(["DenseOnly", "Block"], PKG):
        checkpoint = get_backend("savedmodel").load(path)
    assert checkpoint.metadata["revived_from"]["plain"] == "traced"
    x, y = _data()
    assert_trains_alike(known, checkpoint.model, x, y, epochs=2)


def test_training_counts_unless_a_keras_call_never_reads_it():
    from trainer.save_backends.savedmodel.save import tracing

    class UsersDense(layers.Dense):  # the user's class: taken at its signature
        pass

    ignored = [layers.Dense(2), layers.EinsumDense("ab,bc->ac", 3)]
    read = [layers.Dropout(0.1), layers.BatchNormalization(), layers.GaussianNoise(0.1)]
    read += [layers.LSTM(2), layers.RandomFlip(), UsersDense(2)]
    assert [tracing.training_matters(x) for x in ignored] == [False] * len(ignored)
    assert [tracing.training_matters(x) for x in read] == [True] * len(read)
