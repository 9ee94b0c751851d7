"""Keras's per-layer state protocol through every backend (issue 14, defects 1-3 and 20):
adapted preprocessing layers and layers with state of their own load with the same
outputs, or not at all; a layer's own hook failing is named as such."""

from __future__ import annotations

import json
import shutil

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.fault_corpus import reseal
from trainer.errors import IncompatibleFormatError, LayerStateError, TrainerError
from trainer.model_state import kit
from trainer.save_backends import get_backend, hdf5_arrays

CONFIG_BACKENDS = ("h5", "weights")  # the savedmodel backend: see SAVEDMODEL below
SAVEDMODEL = "savedmodel"


@keras.saving.register_keras_serializable(package="test_layer_state")
class Counter(keras.layers.Layer):
    """Keeps a NumPy array outside Keras variables, stored through the protocol, plus a
    text asset; adds both to its input so that a lost state shows in the outputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.counts = np.zeros(3, "float32")
        self.offset = 0.0
        self.fail_on = None

    def call(self, x):
        return x + self.counts + self.offset

    def save_own_variables(self, store):
        if self.fail_on == "save":
            raise RuntimeError("counter refuses to save")
        store["counts"] = self.counts

    def load_own_variables(self, store):
        if self.fail_on == "load" or CounterFailure.armed:
            raise RuntimeError("counter refuses to load")
        self.counts = np.asarray(store["counts"])

    def save_assets(self, dir_path):
        with open(f"{dir_path}/offset.txt", "w") as handle:
            handle.write(str(self.offset))

    def load_assets(self, dir_path):
        with open(f"{dir_path}/offset.txt") as handle:
            self.offset = float(handle.read())


class CounterFailure:
    armed = False


def roundtrip(backend, model, tmp_path):
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    return get_backend(backend).load(path).model


def adapted_model(layer, data):
    layer.adapt(data)
    dtype = "string" if data.dtype.kind == "U" else str(data.dtype)
    inputs = keras.Input(shape=data.shape[1:], dtype=dtype)
    model = keras.Model(inputs, layer(inputs))
    model.compile(loss="mse")
    return model


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, SAVEDMODEL])
def test_adapted_normalization_keeps_its_statistics(backend, tmp_path):
    data = np.random.default_rng(0).normal(5.0, 3.0, size=(64, 4)).astype("float32")
    model = adapted_model(keras.layers.Normalization(), data)
    expected = model.predict(data, verbose=0)
    loaded = roundtrip(backend, model, tmp_path)
    np.testing.assert_allclose(loaded.predict(data, verbose=0), expected, atol=1e-5)


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, "savedmodel"])
def test_adapted_string_lookup_keeps_its_vocabulary(backend, tmp_path):
    data = np.array([["b"], ["c"], ["a"], ["b"], ["zz"], ["c"], ["b"]])
    model = adapted_model(keras.layers.StringLookup(), data)
    probe = tf.constant([["a"], ["b"], ["c"], ["unseen"]])  # predict() takes no NumPy str
    expected = model(probe).numpy()
    loaded = roundtrip(backend, model, tmp_path)
    np.testing.assert_array_equal(loaded(probe).numpy(), expected)


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, SAVEDMODEL])
def test_adapted_integer_lookup_keeps_its_vocabulary(backend, tmp_path):
    data = np.array([[7], [3], [7], [12], [3], [7]], dtype="int64")
    model = adapted_model(keras.layers.IntegerLookup(), data)
    probe = np.array([[3], [7], [12], [99]], dtype="int64")
    expected = model.predict(probe, verbose=0)
    loaded = roundtrip(backend, model, tmp_path)
    np.testing.assert_array_equal(loaded.predict(probe, verbose=0), expected)


def counter_model() -> keras.Model:
    inputs = keras.Input((3,))
    counter = Counter(name="counter")
    model = keras.Model(inputs, counter(inputs))
    counter.counts = np.array([5, 6, 7], "float32")
    counter.offset = 0.5
    model.compile(loss="mse")
    return model


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, SAVEDMODEL])
def test_state_kept_outside_variables_and_assets_comes_back(backend, tmp_path):
    loaded = roundtrip(backend, counter_model(), tmp_path)
    layer = loaded.get_layer("counter")
    np.testing.assert_array_equal(layer.counts, [5, 6, 7])
    assert layer.offset == 0.5
    np.testing.assert_allclose(loaded.predict(np.zeros((1, 3)), verbose=0), [[5.5, 6.5, 7.5]])


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, SAVEDMODEL])
def test_a_layer_failing_to_save_its_state_is_named(backend, tmp_path):
    model = counter_model()
    model.get_layer("counter").fail_on = "save"
    with pytest.raises(TrainerError, match=r"'counter'.*save_own_variables.*refuses to save"):
        get_backend(backend).save(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.h5").exists()


@pytest.mark.parametrize("backend", CONFIG_BACKENDS)
def test_a_layer_failing_to_load_its_state_is_named_not_called_damaged(backend, tmp_path):
    path = get_backend(backend).save(counter_model(), tmp_path / "ckpt")
    CounterFailure.armed = True
    try:
        with pytest.raises(LayerStateError) as caught:
            get_backend(backend).load(path)
    finally:
        CounterFailure.armed = False
    message = str(caught.value)
    assert "refuses to load" in message and "load_own_variables" in message
    assert "model=" not in message and "damaged;" not in message


def downgrade_to_version_1(backend: str, path, model) -> None:
    """Rewrite a fresh checkpoint as the version 1 writer laid it out: h5 with
    ``model.weights`` by position instead of per-layer state, weights without assets/."""
    if backend == "h5":
        with h5py.File(path, "r+") as handle:
            hdf5_arrays.write_arrays(handle, "model_weights", kit.model_weight_arrays(model))
            del handle["layers"]
            metadata = json.loads(handle["metadata"].asstr()[()])
            del handle["metadata"]
            metadata["format_version"] = 1
            hdf5_arrays.write_text(handle, "metadata", json.dumps(metadata))
    elif backend == "savedmodel":
        (path / "assets.extra" / "trainer_layer_state.h5").unlink(missing_ok=True)
        meta_file = path / "assets.extra" / "trainer_metadata.json"
        meta = json.loads(meta_file.read_text())
        meta["format_version"] = 1
        meta_file.write_text(json.dumps(meta))
    else:
        shutil.rmtree(path / "assets", ignore_errors=True)
        index = json.loads((path / "trainer.json").read_text())
        index["format_version"] = index["metadata"]["format_version"] = 1
        (path / "trainer.json").write_text(json.dumps(index))
    reseal(path)


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, "savedmodel"])
def test_version_1_files_load_plain_models_and_refuse_layers_with_own_state(backend, tmp_path):
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    plain.compile(optimizer="adam", loss="mse")
    path = get_backend(backend).save(plain, tmp_path / "plain")
    downgrade_to_version_1(backend, path, plain)
    loaded = get_backend(backend).load(path).model
    x = np.ones((2, 3), "float32")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), plain.predict(x, verbose=0))

    special = counter_model()
    path = get_backend(backend).save(special, tmp_path / "special")
    downgrade_to_version_1(backend, path, special)
    with pytest.raises(IncompatibleFormatError, match=r"older trainer.*'counter' \(Counter\)"):
        get_backend(backend).load(path)


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, "savedmodel"])
def test_load_without_compile_returns_an_uncompiled_model(backend, tmp_path):
    """Issue 14, defect 14: savedmodel returned a compiled model with a fresh optimizer."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    loaded = get_backend(backend).load(path, compile=False).model
    assert not loaded.compiled and getattr(loaded, "optimizer", None) is None
    compiled = get_backend(backend).load(path).model
    assert compiled.compiled and int(compiled.optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("backend", [*CONFIG_BACKENDS, "savedmodel"])
def test_saving_leaves_the_live_models_losses_alone(backend, tmp_path):
    """Issue 14, defect 8: a savedmodel save emptied ``model.losses`` of the live model."""
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, activity_regularizer="l2", kernel_regularizer="l1")
    model = keras.Model(inputs, dense(inputs))
    model.compile(loss="mse")
    model(np.ones((2, 3), "float32"))
    before = [float(loss) for loss in model.losses]
    assert len(before) == 2
    get_backend(backend).save(model, tmp_path / "ckpt")
    assert [float(loss) for loss in model.losses] == before
