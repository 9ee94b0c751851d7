"""A layer whose call uses ``tf.custom_gradient``, revived from its traces (class missing).

Such a layer predicted as saved, and refused training: trainer saved with
``SaveOptions(experimental_custom_gradients=False)``, so the SavedModel held no gradient
for its traced ``IdentityN`` op. Now the save stores the traced gradient functions where a
layer's traces use one (other saves are unchanged), TensorFlow's loader and trainer's
partial import register them, and the revived layer trains exactly as the original. A
gradient TensorFlow cannot save leaves the save going on without it, and that layer still
refuses training, saying why.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops
from tensorflow.core.protobuf import saved_model_pb2

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.errors import RevivedCallError
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.features import python_gradients

PKG = "pygrad"


@keras.saving.register_keras_serializable(PKG)
class ClippedIdentity(layers.Layer):
    """A matmul whose input gradient is clipped (straight-through with a clip): what
    reaches the layers before it depends on the Python gradient. ``outside`` makes the
    gradient read a tensor made outside every trace, which TensorFlow cannot save."""

    def __init__(self, outside: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.outside = outside
        self.factor = tf.constant(np.full((1,), 0.5, "float32"))

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), initializer="ones")

    def call(self, x):
        @tf.custom_gradient
        def clipped(t):
            def grad(dy):
                dy = tf.clip_by_value(dy, -0.05, 0.05)
                return dy * self.factor if self.outside else dy

            return tf.identity(t), grad

        return ops.matmul(clipped(x), self.kernel)

    def get_config(self):
        return {**super().get_config(), "outside": self.outside}


def _model(outside: bool = False) -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = layers.Dense(5, name="before")(inputs)
    hidden = ClippedIdentity(outside, name="clipped")(hidden)
    model = keras.Model(inputs, layers.Dense(1, name="after")(hidden))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(16, 4)).astype("float32"), np.full((16, 1), 5.0, "float32")


def _revived(path):
    with classes_hidden(["ClippedIdentity"], PKG):
        model = get_backend("savedmodel").load(path).model
    assert type(model.get_layer("clipped")).__name__ == "ClippedIdentity"
    assert not isinstance(model.get_layer("clipped"), ClippedIdentity)  # from its traces
    return model


def _registered_gradients(path) -> int:
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((path / "saved_model.pb").read_bytes())
    return len(proto.meta_graphs[0].graph_def.library.registered_gradients)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model()
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("pygrad") / "ckpt")
    return model, path


def test_the_save_holds_the_traced_gradient(saved):
    _, path = saved
    assert _registered_gradients(path) >= 1


def test_the_revived_layer_trains_exactly_like_the_original(saved):
    model, path = saved
    revived = _revived(path)
    x, y = _data()
    np.testing.assert_allclose(revived.predict(x, verbose=0), model.predict(x, verbose=0))
    before = model.get_layer("before").kernel.numpy()
    for each in (model, revived):
        each.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    moved = np.abs(model.get_layer("before").kernel.numpy() - before).max()
    assert np.isfinite(moved) and moved > 0  # the clipped gradient reached the first layer
    for mine, theirs in zip(model.weights, revived.weights, strict=True):
        assert mine.path == theirs.path
        np.testing.assert_allclose(theirs.numpy(), mine.numpy(), rtol=1e-6, err_msg=mine.path)


def test_a_gradient_tensorflow_cannot_save_leaves_the_layer_refusing_training(tmp_path, caplog):
    model = _model(outside=True)
    with caplog.at_level(logging.WARNING):
        path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert "Custom gradients left out of the SavedModel" in caplog.text
    assert _registered_gradients(path) == 0
    revived = _revived(path)
    x, y = _data()
    np.testing.assert_allclose(revived.predict(x, verbose=0), model.predict(x, verbose=0))
    with pytest.raises(RevivedCallError, match=r"gradient from Python \(tf.custom_gradient\)"):
        revived.fit(x, y, epochs=1, verbose=0)
    get_backend("savedmodel").load(path).model.fit(x, y, epochs=1, verbose=0)  # class known


def test_records_and_the_refusal_rule():
    """Files written before gradients were saved mark the layer but not the save."""
    records = [{"python_gradient": True}, None, {"id": 2}]
    assert python_gradients.marked(records)
    assert not python_gradients.trainable_when_revived(records[0])
    python_gradients.set_saved(records, True)
    assert python_gradients.trainable_when_revived(records[0])
    assert records[2] == {"id": 2}
    assert not python_gradients.marked([{"id": 0}, None])


def test_a_model_without_custom_gradients_saves_no_gradient(tmp_path):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, layers.Dense(1)(layers.Dense(5)(inputs)))
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert _registered_gradients(path) == 0


class _TableOfThisProcess(tf.saved_model.experimental.TrackableResource):
    """A hash table that can be created eagerly but not in the graph a SavedModel is
    exported into: every save fails with a ``ValueError`` that has nothing to do with
    gradients. Counts the creations a save tried."""

    def __init__(self):
        self.tried_for_a_save = 0
        super().__init__()

    def _create_resource(self):  # TrackableResource's documented override point
        if not tf.executing_eagerly():
            self.tried_for_a_save += 1
            raise ValueError("this table cannot be created outside its process")
        return tf.raw_ops.HashTableV2(key_dtype=tf.string, value_dtype=tf.int64)


class _HoldsATable(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = _TableOfThisProcess()

    def call(self, x):
        return x


def test_a_save_failing_for_another_reason_is_not_retried_without_gradients(tmp_path, caplog):
    """Only TensorFlow's refusal of a gradient function makes the save go on without the
    gradients: any other ``ValueError`` surfaces from the one save that raised it."""
    inputs = keras.Input((4,))
    holder = _HoldsATable(name="holder")
    hidden = ClippedIdentity(name="clipped")(layers.Dense(5, name="before")(inputs))
    model = keras.Model(inputs, holder(hidden))
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(ValueError, match="cannot be created outside its process"),
    ):
        get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert "Custom gradients left out" not in caplog.text
    assert holder.table.tried_for_a_save == 1
