"""A subclassed model taking strings (found by a fidelity probe): Keras records no input
dtype for it and its export signature assumes floats, so its SavedModel took float32 (a
cast TensorFlow cannot run: nothing served), its traces could not be called on strings
once its class was missing, and the async copy's first call on float zeros failed."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.save_backends import load_checkpoint

PACKAGE = "test_string_inputs"


@keras.saving.register_keras_serializable(package=PACKAGE)
class TextModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.words = keras.layers.TextVectorization(
            output_mode="count", vocabulary=["a", "b", "dd", "zz"]
        )
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(self.words(x))


def test_a_subclassed_model_on_strings_serves_revives_and_saves_async(tmp_path, caplog):
    x = tf.constant(["a b", "c dd a", "zz zz"])
    model = TextModel()
    expected = model(x).numpy()
    model.compile(optimizer="adam", loss="mse")
    policy = CheckpointPolicy(async_save=True)
    with CheckpointManager(tmp_path / "ckpt", backend="savedmodel", policy=policy) as manager:
        manager.save(model)
        manager.wait()
        path = manager.latest()
    assert not [r for r in caplog.records if "written synchronously" in r.getMessage()]
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    ((name, spec),) = signature.structured_input_signature[1].items()
    assert spec.dtype == tf.string
    (served,) = signature(**{name: x}).values()
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(load_checkpoint(path).model(x).numpy(), expected, rtol=1e-6)
    with classes_hidden(["TextModel"], PACKAGE):
        revived = load_checkpoint(path).model
    assert not isinstance(revived, TextModel)
    np.testing.assert_allclose(revived(x).numpy(), expected, rtol=1e-6)
