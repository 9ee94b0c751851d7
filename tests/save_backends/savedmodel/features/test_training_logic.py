"""A subclassed model that overrides its training logic (``train_step``, ``compute_loss``,
...) and is loaded through savedmodel without its class: revived from its traced functions
it computes its outputs as saved, but ``fit`` ran Keras's default steps instead of its own,
silently (evaluate loss 1.13 where the model's own gave 2.05). Now a compiled load is
refused, and an uncompiled one (inference) refuses to train or evaluate."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.errors import MissingClassError
from trainer.save_backends import get_backend, load_checkpoint

PACKAGE = "test_training_logic"
X = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")


@keras.saving.register_keras_serializable(PACKAGE)
class PlainSubclass(keras.Model):
    """Overrides nothing of the training logic: revived from traces, it trains as saved."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


@keras.saving.register_keras_serializable(PACKAGE)
class PenalizedModel(PlainSubclass):
    """Adds a penalty on its outputs to the compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + keras.ops.mean(keras.ops.square(y_pred))


def _saved(cls, tmp_path):
    keras.utils.set_random_seed(0)
    model = cls()
    model(X[:1])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=16, verbose=0, shuffle=False)
    return model, get_backend("savedmodel").save(model, tmp_path / "ckpt")


def test_a_model_whose_training_logic_is_missing_is_not_compiled(tmp_path):
    model, path = _saved(PenalizedModel, tmp_path)
    with classes_hidden(["PenalizedModel"], PACKAGE):
        with pytest.raises(MissingClassError, match="overrides compute_loss"):
            load_checkpoint(path)
        loaded = load_checkpoint(path, compile=False).model
    np.testing.assert_array_equal(loaded(X), model(X))  # inference is as saved
    loaded.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(MissingClassError, match="PenalizedModel"):
        loaded.fit(X, Y, verbose=0)
    with pytest.raises(MissingClassError, match="PenalizedModel"):
        loaded.evaluate(X, Y, verbose=0)


def test_with_its_class_the_same_checkpoint_loads_and_trains_as_saved(tmp_path):
    model, path = _saved(PenalizedModel, tmp_path)
    loaded = load_checkpoint(path).model
    assert type(loaded) is PenalizedModel
    want = model.evaluate(X, Y, verbose=0)
    assert loaded.evaluate(X, Y, verbose=0) == want


def test_a_subclass_keeping_keras_training_logic_still_loads_compiled_from_traces(tmp_path):
    model, path = _saved(PlainSubclass, tmp_path)
    with classes_hidden(["PlainSubclass"], PACKAGE):
        checkpoint = load_checkpoint(path)
    assert checkpoint.metadata["revived_from"][model.name] == "traced"
    assert checkpoint.model.evaluate(X, Y, verbose=0) == model.evaluate(X, Y, verbose=0)


# A registered Functional or Sequential subclass without its own constructor: its config is
# its graph's, and a load without its class rebuilt a plain Functional from it, dropping the
# class's call() (outputs off, silently) and its compute_loss (trained on another loss).
@keras.saving.register_keras_serializable(PACKAGE)
class Doubling(keras.Model):
    def call(self, inputs, training=None, mask=None):
        return 2.0 * super().call(inputs, training=training, mask=mask) + 1.0


class _Penalty:
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 10.0 * keras.ops.mean(keras.ops.square(y_pred))


@keras.saving.register_keras_serializable(PACKAGE)
class PenalizedFunctional(_Penalty, keras.Model):
    pass


@keras.saving.register_keras_serializable(PACKAGE)
class PenalizedSequential(_Penalty, keras.Sequential):
    pass


@keras.saving.register_keras_serializable(PACKAGE)
class Described(keras.Model):
    """Adds a helper only: it computes and trains as its graph does."""

    def describe(self):
        return f"{self.name}: {len(self.layers)} layers"


def _graph(cls, tmp_path):
    keras.utils.set_random_seed(0)
    if cls is PenalizedSequential:
        model = cls([keras.Input((8,)), keras.layers.Dense(2)], name="m")
    else:
        inputs = keras.Input((8,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
        model = cls(inputs, keras.layers.Dense(2)(hidden), name="m")
    model.compile("sgd", "mse")
    return model, get_backend("savedmodel").save(model, tmp_path / "ckpt")


def test_a_graph_subclass_overriding_call_revives_from_its_traces(tmp_path):
    model, path = _graph(Doubling, tmp_path)
    with classes_hidden(["Doubling"], PACKAGE):
        checkpoint = load_checkpoint(path)
    loaded = checkpoint.model
    assert checkpoint.metadata["revived_from"]["m"] == "traced"
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0))
    np.testing.assert_allclose(loaded(X, training=True), model(X, training=True), atol=1e-5)
    y = np.ones((32, 2), "float32")
    for each in (model, loaded):
        each.fit(X, y, batch_size=16, verbose=0, shuffle=False)
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0), 1e-5)


@pytest.mark.parametrize("cls", [PenalizedFunctional, PenalizedSequential])
def test_a_graph_subclass_overriding_its_loss_is_not_compiled_without_it(tmp_path, cls):
    model, path = _graph(cls, tmp_path)
    with classes_hidden([cls.__name__], PACKAGE):
        with pytest.raises(MissingClassError, match=f"{cls.__name__}.*overrides compute_loss"):
            load_checkpoint(path)
        loaded = load_checkpoint(path, compile=False).model
    np.testing.assert_allclose(loaded.predict(X, verbose=0), model.predict(X, verbose=0))
    loaded.compile("sgd", "mse")
    with pytest.raises(MissingClassError, match=cls.__name__):
        loaded.fit(X, np.ones((32, 2), "float32"), verbose=0)


def test_a_graph_subclass_adding_only_helpers_still_loads_as_its_graph(tmp_path):
    model, path = _graph(Described, tmp_path)
    with classes_hidden(["Described"], PACKAGE):
        checkpoint = load_checkpoint(path)
    assert checkpoint.metadata["revived_from"]["m"] == "graph"
    np.testing.assert_array_equal(
        checkpoint.model.predict(X, verbose=0), model.predict(X, verbose=0)
    )
