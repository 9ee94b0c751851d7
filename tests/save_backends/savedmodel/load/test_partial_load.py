"""A load whose custom class is missing imports only the traced functions it needs (issue 17).

Layers rebuilt from their classes never call their traced functions, so the selective
import (``savedmodel/partial_load.py``) leaves them out of the function library it imports;
the revived model must still match the saved one in outputs, training behaviour, fitting
and a further save.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from tensorflow.core.protobuf import saved_model_pb2

from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.load import partial_load

NAME = "trainer_test_pruned>NormBlock"


@keras.saving.register_keras_serializable(package="trainer_test_pruned", name="NormBlock")
class NormBlock(keras.layers.Layer):
    """Dense + BatchNormalization: training=True normalises by the batch, so a revival that
    lost the training mode would give other outputs."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.dense = keras.layers.Dense(width)
        self.norm = keras.layers.BatchNormalization()

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build((*input_shape[:-1], self.width))

    def call(self, inputs, training=None):
        return keras.ops.relu(self.norm(self.dense(inputs), training=training))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(6,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="stem")(inputs)
    h = NormBlock(8, name="block_a")(h)
    h = keras.layers.Dense(8, activation="tanh", name="middle")(h)
    h = NormBlock(8, name="block_b")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    model.fit(_x(), np.ones((16, 3), "float32"), epochs=1, verbose=0)
    return model


def _x() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(16, 6)).astype("float32")


def _library_size(path) -> int:
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((path / "saved_model.pb").read_bytes())
    return len(proto.meta_graphs[0].graph_def.library.function)


def _load_missing(backend, path):
    objects = keras.saving.get_custom_objects()
    removed = objects.pop(NAME)
    try:
        return backend.load(path)
    finally:
        objects[NAME] = removed


def test_class_missing_load_imports_part_of_the_library_and_behaves_as_saved(tmp_path):
    backend = get_backend("savedmodel")
    model = _model()
    backend.save(model, tmp_path / "first")
    x = _x()

    checkpoint = _load_missing(backend, tmp_path / "first")
    revived = checkpoint.model
    how = checkpoint.metadata["revived_from"]
    assert how["block_a"] == how["block_b"] == "traced"
    assert how["stem"] == how["middle"] == how["head"] == "config"
    imported = checkpoint.metadata["traced_functions_imported"]
    assert 0 < imported < _library_size(tmp_path / "first")

    for training in (False, True):
        np.testing.assert_allclose(
            revived(x, training=training).numpy(),
            model(x, training=training).numpy(),
            atol=1e-5,
        )
    moving = [w for w in model.weights if "moving" in w.path]
    revived_moving = [w for w in revived.weights if "moving" in w.path]
    assert len(moving) == len(revived_moving) == 4
    for saved, loaded in zip(moving, revived_moving, strict=True):
        np.testing.assert_array_equal(saved.numpy(), loaded.numpy())

    # A further save of the revived model reloads exactly (still without the class).
    backend.save(revived, tmp_path / "second")
    again = _load_missing(backend, tmp_path / "second").model
    np.testing.assert_array_equal(again(x).numpy(), revived(x).numpy())

    # Fitting trains the revived model like the original: same step, same weights.
    y = np.zeros((16, 3), "float32")
    before = [w.numpy() for w in revived.trainable_weights]
    revived.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    after = [w.numpy() for w in revived.trainable_weights]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    np.testing.assert_allclose(revived(x).numpy(), model(x).numpy(), atol=1e-5)


def _declined(*args, **kwargs):
    return None


def _broken(*args, **kwargs):
    raise ValueError("an unexpected object graph")


@pytest.mark.parametrize("failure", [_declined, _broken], ids=["declined", "raised"])
def test_when_the_selective_import_cannot_go_the_full_import_revives_the_same_model(
    tmp_path, monkeypatch, failure
):
    """The selective import declines (``plan`` returns ``None``: a SavedModel it cannot
    prune safely) or fails on something unexpected: the load falls back to
    ``tf.saved_model.load`` of the whole directory and the model is the same."""
    backend = get_backend("savedmodel")
    model = _model()
    backend.save(model, tmp_path / "ckpt")
    which = "plan" if failure is _declined else "load"
    monkeypatch.setattr(partial_load, which, failure)
    checkpoint = _load_missing(backend, tmp_path / "ckpt")
    assert checkpoint.metadata["revived_from"]["block_a"] == "traced"
    assert checkpoint.metadata["traced_functions_imported"] == _library_size(tmp_path / "ckpt")
    for a, b in zip(model.weights, checkpoint.model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    x = _x()
    for training in (False, True):
        np.testing.assert_allclose(
            checkpoint.model(x, training=training).numpy(),
            model(x, training=training).numpy(),
            atol=1e-5,
        )
