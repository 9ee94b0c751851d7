"""Issue 38, items 2 and 5: subclassed models revived from their traces (their classes
missing at load, savedmodel backend) compute and train as the originals do.

The scenarios are those of tf-keras' SavedModel revival tests (a subclassed model with
nested or sparse models inside, input specs, ``training`` defaults, a layer with updates,
a model made in a strategy scope, a stateful RNN, several inputs with and without
``training``), written anew in Keras 3 terms. Each model is saved once per module; each
test loads it with its classes hidden, as if the module defining them were never imported,
and compares outputs and one training step against the original (restored to the saved
values first, so both start alike).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.save_backends import get_backend

PKG = "subrev"
register = keras.saving.register_keras_serializable(PKG)


# ----------------------------------------------------------------------- item 2
@register
class NormDropNet(keras.Model):
    """Dense -> BatchNormalization -> Dropout in a ``call`` without ``training``: Keras
    hands ``training`` to the sublayers through its call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8)
        self.norm = layers.BatchNormalization(momentum=0.5)
        self.drop = layers.Dropout(0.5, seed=3)
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.drop(self.norm(self.dense(x))))


# ----------------------------------------------------------------- training defaults
@register
class ZeroInTraining(layers.Layer):
    """Zeros in training, identity otherwise (``training=None`` by default)."""

    def call(self, x, training=None):
        return x * 0.0 if training else x


@register
class ZeroByDefault(layers.Layer):
    """The same, but ``training`` defaults to True."""

    def call(self, x, training=True):
        return x * 0.0 if training else x


@register
class ZeroIfAsked(layers.Layer):
    """``training`` is required."""

    def call(self, x, training):
        return x * 0.0 if training else x


@register
class DefaultsNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)
        self.none = ZeroInTraining()
        self.true = ZeroByDefault()
        self.required = ZeroIfAsked()

    def call(self, x):
        h = self.dense(x)
        return self.none(h) + 2.0 * self.true(h) + 4.0 * self.required(h, training=False)


@register
class TrainingTrueNet(keras.Model):
    """``call(x, training=True)``: a call without ``training`` trains (BatchNormalization
    normalises by the batch and moves its statistics)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4)
        self.norm = layers.BatchNormalization(momentum=0.5)

    def call(self, x, training=True):
        return self.norm(self.dense(x), training=training)


# ----------------------------------------------------------------------- updates
@register
class CountsTrainingCalls(layers.Layer):
    """Adds one to a non-trainable variable per training call (``training=True`` by
    default, as in tf-keras' test)."""

    def build(self, shape):
        self.v = self.add_weight(shape=(), initializer="zeros", trainable=False, name="v")

    def call(self, x, training=True):
        if training:
            self.v.assign_add(1.0)
        return x * 2.0


@register
class UpdateNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)
        self.counter = CountsTrainingCalls()

    def call(self, x, training=None):
        return self.counter(self.dense(x), training=training)


# ----------------------------------------------------------------------- data
def _x(n=8, d=6, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype("float32")


def _y(n=8, d=1, seed=1):
    return np.random.default_rng(seed).normal(size=(n, d)).astype("float32")


def _trained(model, x, y):
    keras.utils.set_random_seed(7)
    model(x[:2])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    return model


class Saved:
    """A model, its checkpoint, and a fresh revival of it with its classes hidden."""

    def __init__(self, model, path, hidden):
        self.model = model
        self.path = get_backend("savedmodel").save(model, path)
        self.hidden = hidden
        self.values = [v.numpy() for v in model.variables]

    def revive(self):
        """The original at its saved values, and a new revival (class missing)."""
        for v, value in zip(self.model.variables, self.values, strict=True):
            v.assign(value)
        with classes_hidden(self.hidden, PKG):
            checkpoint = get_backend("savedmodel").load(self.path)
        revived = checkpoint.model
        assert checkpoint.metadata["revived_from"][self.model.name] == "traced"
        assert type(revived).__name__ == type(self.model).__name__
        assert type(revived) is not type(self.model)
        return self.model, revived


def _same_variables(a, b, atol=1e-5):
    assert len(a.variables) == len(b.variables)
    for x, y in zip(a.variables, b.variables, strict=True):
        np.testing.assert_allclose(x.numpy(), y.numpy(), atol=atol, err_msg=x.path)


def _fit_both(known, revived, x, y, **fit):
    for model in (known, revived):
        keras.utils.set_random_seed(11)
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False, **fit)
    _same_variables(known, revived)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every model of this module, trained a step and saved once."""
    root = tmp_path_factory.mktemp("subclassed")
    x, y = _x(), _y()
    cases = {
        "norm_drop": (NormDropNet(name="norm_drop"), y, ["NormDropNet"]),
        "defaults": (
            DefaultsNet(name="defaults"),
            _y(d=3),
            ["DefaultsNet", "ZeroInTraining", "ZeroByDefault", "ZeroIfAsked"],
        ),
        "training_true": (TrainingTrueNet(name="training_true"), _y(d=4), ["TrainingTrueNet"]),
        "update": (UpdateNet(name="update"), _y(d=3), ["UpdateNet", "CountsTrainingCalls"]),
    }
    return {
        key: Saved(_trained(model, x, target), root / key, hidden)
        for key, (model, target, hidden) in cases.items()
    }


# ----------------------------------------------------------------------- item 2
def test_norm_dropout_without_training_argument_trains_like_the_original(saved):
    known, revived = saved["norm_drop"].revive()
    x, y = _x(), _y()
    np.testing.assert_allclose(revived(x).numpy(), known(x).numpy(), atol=1e-5)
    _fit_both(known, revived, x, y)

    # a training call: batch statistics, moving statistics moved, Dropout dropping
    moving = [v.numpy() for v in revived.non_trainable_variables if "moving" in v.path]
    outputs = [m(x, training=True).numpy() for m in (known, revived)]
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-5)
    _same_variables(known, revived)
    moved = [v.numpy() for v in revived.non_trainable_variables if "moving" in v.path]
    assert all(not np.allclose(a, b) for a, b in zip(moving, moved, strict=True))
    assert not np.allclose(outputs[1], revived(x, training=False).numpy(), atol=1e-3)
    hidden = [m.layers[0](x) for m in (known, revived)]  # the dense, rebuilt from config
    np.testing.assert_allclose(hidden[1].numpy(), hidden[0].numpy(), atol=1e-5)


# ----------------------------------------------------------------------- item 5
def test_training_defaults_of_sublayers_survive(saved):
    known, revived = saved["defaults"].revive()
    x = _x()
    for training in (None, False, True):
        kwargs = {} if training is None else {"training": training}
        np.testing.assert_allclose(
            revived(x, **kwargs).numpy(),
            known(x, **kwargs).numpy(),
            atol=1e-5,
            err_msg=f"training={training}",
        )
    _fit_both(known, revived, x, _y(d=3))


def test_training_true_default_of_the_model_survives(saved):
    known, revived = saved["training_true"].revive()
    x = _x()
    np.testing.assert_allclose(revived(x).numpy(), known(x).numpy(), atol=1e-5)
    _same_variables(known, revived)  # the call without training moved both alike
    np.testing.assert_allclose(
        revived(x, training=False).numpy(), known(x, training=False).numpy(), atol=1e-5
    )
    _fit_both(known, revived, x, _y(d=4))


def test_a_layer_with_updates_updates_alike(saved):
    known, revived = saved["update"].revive()
    x = _x()
    counter = [m.layers[1].non_trainable_variables[0] for m in (known, revived)]
    assert float(counter[1].numpy()) == float(counter[0].numpy()) == 1.0
    _fit_both(known, revived, x, _y(d=3))
    assert float(counter[1].numpy()) == 2.0
    for training in (None, False, True):
        kwargs = {} if training is None else {"training": training}
        np.testing.assert_allclose(
            revived(x, **kwargs).numpy(), known(x, **kwargs).numpy(), atol=1e-5
        )
        _same_variables(known, revived)
