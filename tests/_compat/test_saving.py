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


def _keras_layer_classes():
    seen, pending = set(), [keras.layers.Layer]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen and sub.__module__.startswith("keras.src.layers"):
                seen.add(sub)
                pending.append(sub)
    return seen


def test_keras_layers_overriding_the_variable_protocol_are_the_known_ones():
    """``loads_own_variables_by_position`` trusts Dense, EinsumDense, Embedding and the
    convolutions to override ``load_own_variables`` for quantization/LoRA only; every
    other Keras layer with its own override keeps state that positional copies would
    miss. A Keras release adding an override changes this list: review it, then update."""
    from trainer._compat.keras import _POSITIONAL_LOAD_MODULES

    overriding = {
        getattr(cls, method).__module__
        for cls in _keras_layer_classes()
        for method in ("load_own_variables", "save_own_variables")
        if getattr(cls, method).__module__.startswith("keras.src.layers")
    }
    state_keepers = {
        "keras.src.layers.preprocessing.discretization",
        "keras.src.layers.preprocessing.feature_space",
        "keras.src.layers.preprocessing.index_lookup",
        "keras.src.layers.preprocessing.normalization",
        "keras.src.layers.preprocessing.text_vectorization",
    }
    assert overriding <= _POSITIONAL_LOAD_MODULES | state_keepers, sorted(
        overriding - _POSITIONAL_LOAD_MODULES - state_keepers
    )
    assert _POSITIONAL_LOAD_MODULES - {"keras.src.layers.layer"} <= overriding
