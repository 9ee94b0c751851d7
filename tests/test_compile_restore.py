"""Compiling a revived SavedModel as saved (issue 14, defect 22): a metric whose class is
missing at load is dropped and reported, as documented, not called damage; every other
metric is kept (all of them were dropped with it, built-in ones and weighted ones too)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras.src.saving import object_registration

from trainer.errors import MissingClassError
from trainer.save_backends import get_backend, load_checkpoint


@keras.saving.register_keras_serializable(package="test_compile_restore")
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
    key = "test_compile_restore>MeanPrediction"
    objects = keras.saving.get_custom_objects()
    names = object_registration.GLOBAL_CUSTOM_NAMES
    cls = objects.pop(key)
    names.pop(cls)
    try:
        checkpoint = load_checkpoint(path)
    finally:
        objects[key], names[cls] = cls, key
    (dropped,) = checkpoint.metadata["dropped_metrics"]
    assert dropped["registered_name"] == key
    assert checkpoint.model.compiled
    assert int(checkpoint.model.optimizer.iterations.numpy()) == 1  # optimizer state kept
    x, y = np.ones((4, 3)), np.zeros((4, 2))
    want = model.evaluate(x, y, verbose=0, return_dict=True)
    got = checkpoint.model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(got) == set(want) - {"mine"} and len(got) == 3  # loss, mae, weighted mse
    assert all(got[name] == want[name] for name in got)


@keras.saving.register_keras_serializable(package="test_compile_restore")
def doubled_mse(y_true, y_pred):
    return 2.0 * keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_missing_loss_function_is_named_as_a_function(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss=doubled_mse)
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = get_backend("h5").save(model, tmp_path / "ckpt")
    key = "test_compile_restore>doubled_mse"
    objects = keras.saving.get_custom_objects()
    names = object_registration.GLOBAL_CUSTOM_NAMES
    function = objects.pop(key)
    names.pop(function)
    try:
        with pytest.raises(MissingClassError, match=r"custom_objects=\{'[^']*doubled_mse': the_f"):
            load_checkpoint(path)
    finally:
        objects[key], names[function] = function, key
