"""Canary for ``trainer._compat.saving``: the in-memory ``.weights.h5`` must hold exactly what
``model.save_weights`` writes, in every Keras version CI runs."""

from __future__ import annotations

import io

import h5py
import keras
import numpy as np

from trainer._compat.saving import keras_weights_file_bytes


def _datasets(handle: h5py.File) -> dict[str, np.ndarray]:
    found = {}
    handle.visititems(
        lambda name, item: (
            found.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None
        )
    )
    return found


def test_in_memory_weights_file_matches_save_weights(tmp_path):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 5)), np.zeros((8, 2)), verbose=0)
    model.save_weights(tmp_path / "x.weights.h5")
    with h5py.File(tmp_path / "x.weights.h5", "r") as handle:
        expected = _datasets(handle)
    with h5py.File(io.BytesIO(bytes(keras_weights_file_bytes(model))), "r") as handle:
        actual = _datasets(handle)
    assert sorted(actual) == sorted(expected) and expected
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=name)
