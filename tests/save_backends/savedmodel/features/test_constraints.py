"""A layer revived from its traced functions (class missing at load) keeps the constraints
of its own variables. Keras applies a constraint in the optimizer, after each update, so no
trace holds it: measured before, the revived layer's weight trained unconstrained (went
negative under a NonNeg constraint), silently."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers, ops

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.errors import MissingClassError, ModelNotReadyError
from trainer.save_backends import get_backend

PKG = "rvc"
RNG = np.random.default_rng(1)
X = RNG.normal(size=(16, 4)).astype("float32")
Y = (-5 + RNG.normal(size=(16, 3))).astype("float32")  # pulls the weight below 0


@keras.saving.register_keras_serializable(PKG)
class AtMostOne(keras.constraints.Constraint):
    def __call__(self, w):
        return ops.minimum(w, 1.0)


@keras.saving.register_keras_serializable(PKG)
class Constrained(layers.Layer):
    def __init__(self, constraint="non_neg", **kwargs):
        super().__init__(**kwargs)
        self.constraint = keras.constraints.get(constraint)

    def build(self, shape):
        self.w = self.add_weight(
            shape=(shape[-1], 3), initializer="ones", name="w", constraint=self.constraint
        )

    def call(self, x):
        return ops.matmul(x, self.w)

    def get_config(self):
        return {**super().get_config(), "constraint": None}


def _model(constraint):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, Constrained(constraint, name="con")(inputs))
    model.compile(keras.optimizers.SGD(0.5), "mse")
    return model


def test_a_revived_layer_trains_its_weight_within_its_constraint(tmp_path):
    model = _model(keras.constraints.NonNeg())
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["Constrained"], PKG):
        checkpoint = get_backend("savedmodel").load(path)
    revived = checkpoint.model
    assert checkpoint.metadata["revived_from"]["con"] == "traced"
    for each in (model, revived):
        each.fit(X, Y, epochs=3, batch_size=16, verbose=0)
    weight = revived.get_layer("con").weights[0].numpy()
    assert weight.min() >= 0.0
    np.testing.assert_allclose(weight, model.get_layer("con").w.numpy(), atol=1e-6)


def test_a_constraint_whose_class_is_missing_is_refused_at_load(tmp_path):
    path = get_backend("savedmodel").save(_model(AtMostOne()), tmp_path / "ckpt")
    message = r"'con'.*constraint.*Received: .*AtMostOne"
    with (
        classes_hidden(["Constrained", "AtMostOne"], PKG),
        pytest.raises(MissingClassError, match=message),
    ):
        get_backend("savedmodel").load(path)


class NoConfig(keras.constraints.Constraint):
    def __call__(self, w):
        return w

    def get_config(self):
        raise NotImplementedError("no config")


def test_a_constraint_without_config_is_refused_at_save(tmp_path):
    with pytest.raises(ModelNotReadyError, match=r"constraint whose config.*Received: "):
        get_backend("savedmodel").save(_model(NoConfig()), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
