"""Compiling a revived SavedModel as saved (issue 14, defect 22): a metric whose class is
missing at load is dropped and reported, as documented, not called damage; every other
metric is kept (all of them were dropped with it, built-in ones and weighted ones too)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from savedmodel_zoo import classes_hidden

from trainer.errors import MissingClassError
from trainer.save_backends import get_backend, load_checkpoint

PACKAGE = "test_compile_restore"


@keras.saving.register_keras_serializable(package=PACKAGE)
class MeanPrediction(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(keras.ops.mean(y_pred))


def test_metric_with_missing_class_is_dropped_and_reported(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(
        optimizer="adam",
        loss="mse",
        metrics=["mae", MeanPrediction(name="mine")],
        weighted_metrics=["mse"],
    )
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["MeanPrediction"], PACKAGE):
        checkpoint = load_checkpoint(path)
    (dropped,) = checkpoint.metadata["dropped_metrics"]
    assert dropped["registered_name"] == f"{PACKAGE}>MeanPrediction"
    assert checkpoint.model.compiled
    assert int(checkpoint.model.optimizer.iterations.numpy()) == 1  # optimizer state kept
    x, y = np.ones((4, 3)), np.zeros((4, 2))
    want = model.evaluate(x, y, verbose=0, return_dict=True)
    got = checkpoint.model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(got) == set(want) - {"mine"} and len(got) == 3  # loss, mae, weighted mse
    assert all(got[name] == want[name] for name in got)


@keras.saving.register_keras_serializable(package=PACKAGE)
def doubled_mse(y_true, y_pred):
    return 2.0 * keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_missing_loss_function_is_named_as_a_function(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss=doubled_mse)
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = get_backend("h5").save(model, tmp_path / "ckpt")
    expected = r"custom_objects=\{'[^']*doubled_mse': the_f"
    with classes_hidden(["doubled_mse"], PACKAGE), pytest.raises(MissingClassError, match=expected):
        load_checkpoint(path)
