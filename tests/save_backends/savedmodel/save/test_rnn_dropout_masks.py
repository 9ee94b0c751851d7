"""An RNN with dropout in a model revived from its traced functions draws the same dropout
masks as the original, from the same seed generator state (issue 42; found by the Keras
layer peer suite on ConvLSTM with ``recurrent_dropout``, ``training=True``).

Before: each layer's trace called its children's traced functions, the RNN cell's too.
An RNN draws its cell's masks once per call and leaves them on the cell; the cell's own
traced function could not see them and drew new ones at every step. The revived model
loaded, then drew three times as many masks as the original (other outputs, another
training step, the generator state advanced further) without a word.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend, load_checkpoint

register = keras.saving.register_keras_serializable(zoo.PKG)


@register
class DropoutRnnModel(keras.Model):
    """A ConvLSTM with input and recurrent dropout, always in training mode, and a head:
    the masks decide the outputs. (Keras' LSTM and GRU cells are rebuilt from their config
    inside a revived model, and never were dispatched; ConvLSTM's cell is traced.)"""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rnn = layers.ConvLSTM1D(3, 3, dropout=0.2, recurrent_dropout=0.5, name="rnn")
        self.head = layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.rnn(x, training=True))


def _seed_states(model) -> list[np.ndarray]:
    return [v.numpy() for v in model.variables if v.path.endswith("seed_generator_state")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(4, 3, 7, 2)).astype("float32")
    model = DropoutRnnModel(name="rnn_model")
    model(x)
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("ckpt") / "c")
    with zoo.classes_hidden(["DropoutRnnModel"]):
        loaded = load_checkpoint(path)
    assert loaded.metadata["revived_from"]["rnn_model"] == "traced"
    return model, loaded.model, x


def test_the_revived_model_draws_the_original_masks(saved):
    model, revived, x = saved
    np.testing.assert_array_equal(_seed_states(model), _seed_states(revived))
    for _ in range(2):  # from the same state, each call alike, and the states move alike
        np.testing.assert_allclose(revived(x).numpy(), model(x).numpy(), atol=1e-6)
        np.testing.assert_array_equal(_seed_states(revived), _seed_states(model))


def test_the_revived_model_trains_alike(saved):
    model, revived, x = saved
    y = np.ones(model(x).shape, "float32")
    for each in (model, revived):
        each.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for variable, other in zip(revived.variables, model.variables, strict=True):
        variable.assign(other)  # the same weights and generator state
    losses = [each.train_on_batch(x, y) for each in (model, revived)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    for a, b in zip(model.variables, revived.variables, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-6, err_msg=a.path)
