"""A model revived from traces (its class missing) is saved again, or exported, with the
signature its checkpoint served. Found by a probe: a subclassed model on int32 ids served
``input_0: int32``; its re-save and ``trainer export`` took the float32 trace also made for
it, so a server's int ids were refused, and the next load refused ``fit`` on them."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.exports.sources import export_from_checkpoint
from trainer.save_backends import get_backend, load_checkpoint


class TokenModel(keras.Model):  # not registered: a load revives it from its traces
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(30, 4)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.pool(self.embed(x)))


def _served_dtypes(path):
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    return {k: v.dtype.name for k, v in signature.structured_input_signature[1].items()}


def test_a_revived_model_on_integer_ids_keeps_its_integer_signature(tmp_path):
    keras.utils.set_random_seed(0)
    ids = np.array([[1, 2, 3, 0], [4, 5, 6, 7]], "int32")
    model = TokenModel()
    model.compile("adam", "mse")
    model.fit(ids, np.zeros((2, 2)), verbose=0)
    backend = get_backend("savedmodel")
    first = backend.save(model, tmp_path / "first")
    assert _served_dtypes(first) == {"input_0": "int32"}
    loaded = load_checkpoint(first).model
    np.testing.assert_array_equal(loaded(ids).numpy(), model(ids).numpy())
    loaded.fit(ids, np.zeros((2, 2)), verbose=0)
    second = backend.save(loaded, tmp_path / "second")
    assert _served_dtypes(second) == {"input_0": "int32"}
    export = export_from_checkpoint(first, tmp_path / "export")
    assert _served_dtypes(export) == {"input_0": "int32"}
    served = tf.saved_model.load(str(export)).signatures["serving_default"]
    (out,) = served(input_0=tf.constant(ids)).values()
    np.testing.assert_allclose(out.numpy(), load_checkpoint(first).model(ids).numpy(), atol=1e-6)
    load_checkpoint(second).model.fit(ids, np.zeros((2, 2)), verbose=0)  # int ids still train


class MaskedTokenModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(30, 4, mask_zero=True)
        self.rnn = keras.layers.GRU(3)

    def call(self, x):
        return self.rnn(self.embed(x))


def test_ids_with_a_zero_mask_are_served_as_integers(tmp_path):
    """``Embedding(mask_zero=True)`` first: its mask compares the ids with 0 before they are
    cast, and the ids were served as float32 (found by a probe; ``mask_zero=False`` gave
    int32, as the docs say an Embedding first does)."""
    keras.utils.set_random_seed(1)
    ids = np.array([[1, 2, 0, 0], [4, 5, 6, 7]], "int32")
    model = MaskedTokenModel()
    model(ids)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert _served_dtypes(path) == {"input_0": "int32"}
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    (out,) = served(input_0=tf.constant(ids)).values()
    np.testing.assert_allclose(out.numpy(), model(ids).numpy(), atol=1e-6)
    revived = load_checkpoint(path).model
    np.testing.assert_allclose(revived(ids).numpy(), model(ids).numpy(), atol=1e-6)


class Plain(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_a_keras_format_export_of_a_revived_model_says_why_it_is_refused(tmp_path):
    """It said "has never called ... Build the model on a batch of data", which calling it
    does not change (found by a probe)."""
    from trainer.errors import ExportError
    from trainer.exports.exporter import export_serving

    x = np.ones((2, 3), "float32")
    model = Plain()
    model(x)
    revived = load_checkpoint(get_backend("savedmodel").save(model, tmp_path / "ckpt")).model
    revived(x)
    with pytest.raises(ExportError, match=r"revived from its traced functions.*format=savedmodel"):
        export_serving(revived, tmp_path / "export", format="keras")
    assert not (tmp_path / "export").exists()
    export_serving(revived, tmp_path / "export", format="savedmodel")
