"""When an async save falls back to synchronous writes, its warning says the real reason:
a layer revived without its class, or which variables the copy made differently."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.checkpointing import AsyncBackend, clone_for_snapshot
from trainer.checkpointing.shadow import SnapshotUnavailable
from trainer.save_backends import get_backend, load_checkpoint

PKG = "test_async_fallback_reasons"


@keras.saving.register_keras_serializable(PKG)
class Doubled(keras.layers.Layer):
    def __init__(self, units=2, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return 2.0 * self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _fitted(model):
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).random((8, model.inputs[0].shape[-1])).astype("float32")
    model.fit(x, np.zeros((8, model.outputs[0].shape[-1]), "float32"), verbose=0)
    return x


def test_revived_layer_falls_back_saying_its_class_was_missing(tmp_path, caplog):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(Doubled(name="doubled")(inputs)))
    x = _fitted(model)
    source = get_backend("savedmodel").save(model, tmp_path / "source")
    with classes_hidden(["Doubled"], PKG), caplog.at_level(logging.WARNING):
        revived = load_checkpoint(source).model
        assert revived.get_layer("doubled")._trainer_revived_from
        revived.fit(x, np.ones((8, 2), "float32"), verbose=0)
        expected = revived.predict(x, verbose=0)
        saver = AsyncBackend(get_backend("savedmodel"))
        path = saver.save(revived, tmp_path / "async")
        saver.wait()
        np.testing.assert_array_equal(load_checkpoint(path).model.predict(x, verbose=0), expected)
    (message,) = [r.getMessage() for r in caplog.records if "synchronously" in r.getMessage()]
    assert "layer 'doubled' was revived from the traced functions" in message
    assert f"its class '{PKG}>Doubled' was not available" in message
    assert "custom_objects={'Doubled': cls}" in message
    assert "register_keras_serializable" not in message


def test_quantized_copy_says_its_variables_come_in_another_order():
    """A model quantized in place makes its float8 scales after its kernels; the copy,
    rebuilt quantized, before them: same count, so "26 vs 26 variables" said nothing."""
    inputs = keras.Input((8,))
    model = keras.Model(
        inputs, keras.layers.Dense(2, name="out")(keras.layers.Dense(8, name="hidden")(inputs))
    )
    model.quantize("float8")
    _fitted(model)
    with pytest.raises(SnapshotUnavailable) as info:
        clone_for_snapshot(model)
    message = str(info.value)
    assert "the same 26 variables, created in another order" in message
    assert "variable 0 is ('hidden/kernel', [8, 8], 'float32') in the model" in message
    assert "('hidden/inputs_scale', [], 'float32') in the copy" in message
