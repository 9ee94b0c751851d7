"""A subclassed model that overrides its training logic (``train_step``, ``compute_loss``,
...) and is loaded through savedmodel without its class: revived from its traced functions
it computes its outputs as saved, but ``fit`` ran Keras's default steps instead of its own,
silently (evaluate loss 1.13 where the model's own gave 2.05). Now a compiled load is
refused, and an uncompiled one (inference) refuses to train or evaluate."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from savedmodel_zoo import classes_hidden

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
