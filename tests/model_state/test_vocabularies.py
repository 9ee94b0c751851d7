"""Lookup vocabularies come back exactly, or the save is refused (found by a fidelity probe).

- savedmodel stored a vocabulary as text: an ``IntegerLookup(vocabulary=[...])`` came back
  with its OOV token ``-1`` as an ordinary word, every index shifted by one;
- Keras's own vocabulary file (every backend restores adapted lookups through it) splits a
  token holding a line break and drops an empty token at the end: refused at save time.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend, load_checkpoint

BACKENDS = ["savedmodel", "h5", "weights"]


def _lookup_model(layer: keras.layers.Layer, dtype: str) -> keras.Model:
    inputs = keras.Input((4,), dtype=dtype)
    return keras.Model(inputs, layer(inputs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_token", [None, 0], ids=["no_mask", "mask"])
def test_integer_lookup_with_a_given_vocabulary_keeps_its_indices(tmp_path, backend, mask_token):
    layer = keras.layers.IntegerLookup(vocabulary=[5, 3, 9], mask_token=mask_token)
    model = _lookup_model(layer, "int64")
    x = np.array([[5, 3, 9, 7], [7, 7, 7, 3]])
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    loaded = load_checkpoint(path).model
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert loaded.layers[-1].get_vocabulary() == layer.get_vocabulary()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_given_vocabulary_with_line_breaks_is_kept_exactly(tmp_path, backend):
    layer = keras.layers.StringLookup(vocabulary=["a", "x\ny", "b\u2028c", ""])
    model = _lookup_model(layer, "string")
    x = tf.constant([["a", "x\ny", "b\u2028c", ""], ["zz", "", "a", "b"]])
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    loaded = load_checkpoint(path).model
    np.testing.assert_array_equal(loaded(x), model(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("data", "why"),
    [
        (["a", "a", "a", "x\ny", "x\ny", "b"], "line break"),
        (["a", "a", "b\rc", "b\rc", "d"], "line break"),
        (["b", "b", "b", "a", "a", ""], "empty and last"),
    ],
    ids=["newline", "carriage_return", "empty_last"],
)
def test_an_adapted_vocabulary_the_file_cannot_hold_is_refused(tmp_path, backend, data, why):
    layer = keras.layers.StringLookup()
    layer.adapt(np.array(data))
    model = _lookup_model(layer, "string")
    with pytest.raises(ModelNotReadyError, match=why):
        get_backend(backend).save(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.h5").exists()


def test_an_adapted_vocabulary_with_an_empty_token_elsewhere_saves(tmp_path):
    layer = keras.layers.StringLookup()
    layer.adapt(np.array(["", "", "", "a", "a", "b"]))  # "" is the most frequent
    model = _lookup_model(layer, "string")
    x = tf.constant([["", "a", "b", "q"]])
    loaded = load_checkpoint(get_backend("h5").save(model, tmp_path / "ckpt")).model
    np.testing.assert_array_equal(loaded(x), model(x))


def test_vocabularies_written_as_text_before_are_read_with_their_token_type(tmp_path):
    from trainer.save_backends.savedmodel.layout import read_vocabulary

    (tmp_path / "vocabulary.txt").write_text("-1\n5\n3")
    assert read_vocabulary(tmp_path, keras.layers.IntegerLookup()) == [-1, 5, 3]
    assert read_vocabulary(tmp_path, keras.layers.StringLookup()) == ["-1", "5", "3"]
    assert read_vocabulary(tmp_path / "none", keras.layers.StringLookup()) is None
