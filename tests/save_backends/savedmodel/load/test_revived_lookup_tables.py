"""A layer revived from traces (its class missing at load) that owned a lookup table: its
loaded functions capture the restored table, which no layer holds. Saving it again, or
exporting it, raised TensorFlow's "untracked resource" AssertionError; the table is now
reached through the revived layer's node and every copy computes what the original did."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.exports.exporter import export_serving
from trainer.save_backends import get_backend, load_checkpoint

PKG = "test_revived_lookup_tables"


@keras.saving.register_keras_serializable(PKG)
class Tokens(keras.layers.Layer):
    def __init__(self, vocabulary=("a", "b", "c"), **kwargs):
        super().__init__(**kwargs)
        self.vocabulary = list(vocabulary)
        self.lookup = keras.layers.StringLookup(vocabulary=self.vocabulary)
        self.embedding = keras.layers.Embedding(len(self.vocabulary) + 1, 2)

    def build(self, input_shape):
        self.embedding.build(input_shape)

    def call(self, x):
        return self.embedding(self.lookup(x))

    def get_config(self):
        return {**super().get_config(), "vocabulary": self.vocabulary}


X = tf.constant([["a", "c"], ["unknown", "b"], ["c", "c"]])


def _model():
    inputs = keras.Input((2,), dtype="string")
    return keras.Model(inputs, keras.layers.Flatten()(Tokens(name="tokens")(inputs)))


def test_revived_layer_with_a_lookup_table_saves_again_and_exports(tmp_path):
    model = _model()
    expected = model(X).numpy()
    source = get_backend("savedmodel").save(model, tmp_path / "source")
    with classes_hidden(["Tokens"], PKG):
        revived = load_checkpoint(source).model
        assert revived.get_layer("tokens")._trainer_revived_from
        again = get_backend("savedmodel").save(revived, tmp_path / "again")
        twice = load_checkpoint(again).model  # still without the class
        np.testing.assert_array_equal(twice(X).numpy(), expected)
        third = get_backend("savedmodel").save(twice, tmp_path / "third")
        np.testing.assert_array_equal(load_checkpoint(third).model(X).numpy(), expected)
        exported = export_serving(revived, tmp_path / "export", format="savedmodel")
        revived.compile(optimizer="adam", loss="mse")
        revived.fit(X, np.ones((3, 4), "float32"), epochs=2, verbose=0)  # trains the table's
        trained = revived(X).numpy()  # users: the Embedding after it
        assert not np.array_equal(trained, expected)
        path = get_backend("savedmodel").save(revived, tmp_path / "trained")
        np.testing.assert_array_equal(load_checkpoint(path).model(X).numpy(), trained)
    serve = tf.saved_model.load(str(exported)).signatures["serving_default"]
    (served,) = serve(X).values()
    np.testing.assert_array_equal(served.numpy(), expected)
    with_class = load_checkpoint(again).model  # the class is back: rebuilt from its config
    assert not getattr(with_class.get_layer("tokens"), "_trainer_revived_from", None)
    np.testing.assert_array_equal(with_class(X).numpy(), expected)
