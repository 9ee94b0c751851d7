"""A stateful LSTM rebuilt from its class under a parent revived from traced functions
(savedmodel): the parent's functions read and update the loaded state variables, and the
LSTM's ``states`` must be those very variables. They were states of its own, at zero: the
outputs matched, but reading, assigning or resetting the states (and so training after a
reset) acted on variables nothing used. A user RNN class missing at load comes back from its
own traces: its stand-in had no states and no reset_state() at all (code resetting the
stateful layers it finds skipped it)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.model_state import layer_protocol
from trainer.save_backends import get_backend

PKG = "test_revived_rnn_states"
X = np.random.default_rng(0).random((2, 3, 5)).astype("float32")
Y = np.random.default_rng(1).random((2, 2)).astype("float32")


@keras.saving.register_keras_serializable(PKG)
class StatefulNet(keras.Model):
    """No build() of its own: a load cannot rebuild it (its symbolic build cannot create
    the LSTM's states) and revives it from its traced functions."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lstm = keras.layers.LSTM(4, stateful=True)
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.lstm(x))


@keras.saving.register_keras_serializable(PKG)
class Recurrent(keras.layers.Layer):
    """A user layer wrapping a stateful LSTM (in a Bidirectional wrapper if asked)."""

    def __init__(self, bidirectional=False, **kwargs):
        super().__init__(**kwargs)
        self.bidirectional = bidirectional
        lstm = keras.layers.LSTM(4, stateful=True)
        self.lstm = keras.layers.Bidirectional(lstm) if bidirectional else lstm

    def build(self, input_shape):
        self.lstm.build(input_shape)

    def call(self, x):
        return self.lstm(x)

    def get_config(self):
        return {**super().get_config(), "bidirectional": self.bidirectional}


@keras.saving.register_keras_serializable(PKG)
class UserLSTM(keras.layers.LSTM):
    """A user RNN class: missing at load, it is revived from its own traced functions."""


def _subclassed():
    model = StatefulNet()
    model(X)
    model.build(X.shape)  # records a build config, as the user would to save it
    return model


def _functional_with_user_layer(bidirectional=False):
    inputs = keras.Input(batch_shape=X.shape)
    outputs = Recurrent(bidirectional=bidirectional)(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(outputs))


def _functional_with_user_rnn():
    inputs = keras.Input(batch_shape=X.shape)
    return keras.Model(inputs, keras.layers.Dense(2)(UserLSTM(4, stateful=True)(inputs)))


def _sequential():
    layers = [keras.Input(batch_shape=X.shape), keras.layers.LSTM(4, stateful=True)]
    return keras.Sequential([*layers, keras.layers.Dense(2)])


CASES = {
    "subclassed, class importable": (_subclassed, []),
    "subclassed, class missing": (_subclassed, ["StatefulNet"]),
    "functional, user layer missing": (_functional_with_user_layer, ["Recurrent"]),
    "functional, user layer with a Bidirectional LSTM missing": (
        lambda: _functional_with_user_layer(bidirectional=True),
        ["Recurrent"],
    ),
    "functional, user RNN class missing": (_functional_with_user_rnn, ["UserLSTM"]),
    "sequential, Keras's own LSTM": (_sequential, []),
}


def _rnns(model):
    found = [
        layer for layer in layer_protocol.stateful_layers(model) if layer_protocol.rnn_states(layer)
    ]
    assert found, f"{model.name}: no stateful RNN with states"
    return found


def _states(model):
    return [v.numpy() for layer in _rnns(model) for v in layer_protocol.rnn_states(layer)]


def _assert_alike(original, loaded, what):
    for name, (a, b) in {
        "states": (_states(original), _states(loaded)),
        "outputs": ([original(X).numpy()], [loaded(X).numpy()]),  # updates the states
        "states after the call": (_states(original), _states(loaded)),
    }.items():
        for left, right in zip(a, b, strict=True):
            np.testing.assert_allclose(right, left, atol=1e-5, err_msg=f"{name} {what}")


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_stateful_lstm_states_are_the_ones_its_model_uses(case, tmp_path):
    make, hidden = CASES[case]
    keras.utils.set_random_seed(3)
    model = make()
    model(X)
    model(X)  # states far from zero
    backend = get_backend("savedmodel")
    path = backend.save(model, tmp_path / "ckpt")
    with classes_hidden(hidden, PKG):
        loaded = backend.load(path).model
        assert np.abs(_states(loaded)[0]).max() > 0.01  # the saved states, not zeros
        _assert_alike(model, loaded, "once loaded")
        _assert_alike(model, loaded, "on the next call")

        for each in (model, loaded):
            for layer in _rnns(each):
                layer.reset_states()
        assert not any(np.abs(s).max() for s in _states(loaded))
        _assert_alike(model, loaded, "after reset_states()")

        for each in (model, loaded):
            for variable in (v for layer in _rnns(each) for v in layer_protocol.rnn_states(layer)):
                variable.assign(np.full(variable.shape, 0.3, "float32"))
        _assert_alike(model, loaded, "after assigning the states")

        for each in (model, loaded):
            for layer in _rnns(each):
                layer.reset_state()
            each.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            each.train_on_batch(X, Y)
        _assert_alike(model, loaded, "after a training step")
        for before, after in zip(model.weights, loaded.weights, strict=True):
            np.testing.assert_allclose(after.numpy(), before.numpy(), atol=1e-5)

        again = backend.load(backend.save(loaded, tmp_path / "again")).model
        _assert_alike(loaded, again, "saved again and loaded")
