"""A layer revived from its traced functions (class missing at load) runs the trace made
with the Python argument values of each call.

Measured before: the plain keyword values of every trace were merged into one set of
defaults, so a shared layer called as ``sa(x)`` and ``sa(x, scale=5.0, use_bias=False)``
ran the second call twice (and trained nothing of its bias); a layer called once with
``scale=5.0`` took 5.0 as its default; one called with ``power=2`` and with a tensor
``context`` did not load (CorruptCheckpointError).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers, ops

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.errors import RevivedCallError
from trainer.save_backends import get_backend

PKG = "rca"


@keras.saving.register_keras_serializable(PKG)
class ScaledAdd(layers.Layer):
    def build(self, shape):
        self.b = self.add_weight(shape=(shape[-1],), initializer="ones", name="b")

    def call(self, x, scale=2.0, use_bias=True):
        y = x * scale
        return y + self.b if use_bias else y


@keras.saving.register_keras_serializable(PKG)
class Gate(layers.Layer):
    def build(self, x_shape, *args, **kwargs):
        self.g = self.add_weight(shape=(x_shape[-1],), initializer="ones", name="g")

    def call(self, x, power=1, context=None):
        y = (x * self.g) ** power
        if context is not None:
            y = y + ops.mean(context, axis=-1, keepdims=True)
        return y


@keras.saving.register_keras_serializable(PKG)
class Tempered(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(3)

    def call(self, x, temperature=1.0):
        return self.d(x) / temperature


def _revive(model, tmp_path, names):
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(names, PKG):
        checkpoint = get_backend("savedmodel").load(path)
    return checkpoint.model


X = np.arange(6, dtype="float32").reshape(2, 3)


def test_a_shared_layer_runs_each_call_with_its_own_keyword_values(tmp_path):
    inputs = keras.Input((3,))
    shared = ScaledAdd(name="sa")
    both = [shared(inputs), shared(inputs, scale=5.0, use_bias=False)]
    model = keras.Model(inputs, layers.Concatenate()(both))
    model.compile("sgd", "mse")
    revived = _revive(model, tmp_path, ["ScaledAdd"])
    assert type(revived.get_layer("sa")).__module__.endswith("standins")
    np.testing.assert_allclose(revived.predict(X, verbose=0), model.predict(X, verbose=0))
    layer = revived.get_layer("sa")
    np.testing.assert_allclose(layer(X).numpy(), X * 2.0 + 1.0)
    np.testing.assert_allclose(layer(X, scale=2.0, use_bias=True).numpy(), X * 2.0 + 1.0)
    np.testing.assert_allclose(layer(X, scale=5.0, use_bias=False).numpy(), X * 5.0)
    y = np.ones((2, 6), "float32")
    for each in (model, revived):
        each.fit(X, y, epochs=2, batch_size=2, verbose=0, shuffle=False)
    for a, b in zip(model.variables, revived.variables, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-6, err_msg=a.path)


def test_a_value_no_trace_was_made_with_is_refused_not_replaced(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, ScaledAdd(name="sa")(inputs, scale=5.0))
    layer = _revive(model, tmp_path, ["ScaledAdd"]).get_layer("sa")
    np.testing.assert_allclose(layer(X, scale=5.0).numpy(), X * 5.0 + 1.0)
    message = r"Python argument values.*scale=5\.0.*Received: scale=2\.0, use_bias=True"
    with pytest.raises(RevivedCallError, match=message):
        layer(X)  # the original's default is 2.0: no trace computes that


@pytest.mark.parametrize("first", ["power", "none"])
def test_a_shared_layer_with_a_tensor_keyword_loads_and_matches(tmp_path, first):
    i, j = keras.Input((3,)), keras.Input((4,))
    gate = Gate(name="gate")
    outs = [gate(i, power=2) if first == "power" else gate(i), gate(i, context=j)]
    model = keras.Model([i, j], layers.Concatenate()(outs))
    x = [X, np.ones((2, 4), "float32")]
    revived = _revive(model, tmp_path, ["Gate"])
    np.testing.assert_allclose(revived.predict(x, verbose=0), model.predict(x, verbose=0))


def test_an_argument_passed_at_its_default_runs_the_trace_made_without_it(tmp_path):
    model = Tempered()
    x = np.ones((1, 4), "float32")
    model(x)
    revived = _revive(model, tmp_path, ["Tempered"])
    np.testing.assert_allclose(revived(x, temperature=1.0).numpy(), model(x).numpy())


@keras.saving.register_keras_serializable(PKG)
class Offset(layers.Layer):
    def call(self, x, offsets=(1.0,)):
        return x if offsets is None else x + offsets[0]


def test_an_explicit_none_is_not_taken_for_a_default_that_is_not_plain(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, Offset(name="offset")(inputs))
    layer = _revive(model, tmp_path, ["Offset"]).get_layer("offset")
    np.testing.assert_allclose(layer(X).numpy(), X + 1.0)
    with pytest.raises(RevivedCallError, match=r"Received: offsets=None"):
        layer(X, offsets=None)  # the original returns x: no trace computes that


def test_a_keyword_no_trace_was_made_with_is_named_as_the_problem(tmp_path):
    model = Tempered()
    x = np.ones((1, 4), "float32")
    model(x)
    revived = _revive(model, tmp_path, ["Tempered"])
    message = r"Python argument values.*temperature=1\.0.*Received: temperature=3\.0"
    with pytest.raises(RevivedCallError, match=message) as caught:
        revived(x, temperature=3.0)
    assert "kind of tensors" not in str(caught.value)  # not blamed on the tensors


def test_a_tensor_no_trace_takes_is_refused_naming_the_keywords_received(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, ScaledAdd(name="sa")(inputs, scale=5.0, use_bias=False))
    layer = _revive(model, tmp_path, ["ScaledAdd"]).get_layer("sa")
    message = r"kind of tensors.*Received: args=.*shape=\(2, 1, 3\).*'scale': 5\.0"
    with pytest.raises(RevivedCallError, match=message):
        layer(X[:, None, :], scale=5.0, use_bias=False)  # traced on rank 2 only
