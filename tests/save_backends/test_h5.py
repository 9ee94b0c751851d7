"""What is specific to the ``h5`` backend: file layout, detection, safe loading."""

from __future__ import annotations

import json

import h5py
import keras
import numpy as np
import pytest

from tests.helpers.fault_corpus import reseal
from trainer.errors import (
    CorruptCheckpointError,
    IncompatibleFormatError,
    MissingClassError,
    NotACheckpointError,
)
from trainer.model_state.layer_protocol import stateful_layers
from trainer.save_backends import detect_backend, load_checkpoint
from trainer.save_backends.h5 import H5Backend
from trainer.state import TrainingState
from trainer.testing import build_model, suite_data, train


@keras.saving.register_keras_serializable(package="test_h5")
class Doubler(keras.layers.Layer):
    def call(self, inputs):
        return inputs * 2.0


@pytest.fixture(scope="module")
def trained():
    model = build_model("sequential")
    train(model, "sequential")
    return model


def test_keras_legacy_h5_fails_on_string_compile_where_ours_works(trained, tmp_path):
    x, y = suite_data("sequential")
    keras.saving.save_model(trained, tmp_path / "legacy.h5")
    with pytest.raises(Exception, match="Could not deserialize"):
        keras.saving.load_model(tmp_path / "legacy.h5")

    # The legacy save above also popped "optimizer" from the live compile config; ours must
    # still restore Adam with all its slots (modelstate.compile_config fills it back in).
    loaded = H5Backend().load(H5Backend().save(trained, tmp_path / "ours")).model
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert loaded.loss == "mse"
    assert loaded.evaluate(x, y, verbose=0) == trained.evaluate(x, y, verbose=0)


def test_file_holds_config_weights_rng_and_every_optimizer_variable(trained, tmp_path):
    path = H5Backend().save(trained, tmp_path / "ckpt", state=TrainingState(epoch=4))
    assert path.name == "ckpt.h5"
    with h5py.File(path, "r") as handle:
        assert handle.attrs["format"] == "trainer-h5"
        assert json.loads(handle["metadata"].asstr()[()])["state"]["epoch"] == 4
        config = json.loads(handle["model_config"].asstr()[()])
        assert config["class_name"] == "Sequential" and "build_config" in config
        assert json.loads(handle["compile_config"].asstr()[()])["loss"] == "mse"
        layers, stored_layers = stateful_layers(trained), handle["layers"]
        assert stored_layers.attrs["count"] == len(layers)
        per_layer = []
        for index, layer in enumerate(layers):
            group = stored_layers[f"{index:05d}"]
            assert group.attrs["class_name"] == type(layer).__name__
            assert group.attrs["name"] == layer.name
            per_layer += [group["arrays"][key][()] for key in sorted(group["arrays"])]
        assert len(per_layer) == len(trained.weights) > 0  # what save_own_variables stored
        for stored, variable in zip(per_layer, trained.weights, strict=True):
            np.testing.assert_array_equal(stored, variable.numpy())
        weight_ids = {id(v) for v in trained.weights}
        groups = {
            "rng_state": [v for v in trained.variables if id(v) not in weight_ids],
            "optimizer": trained.optimizer.variables,
        }
        for name, variables in groups.items():
            stored = handle[name]
            assert len(stored) == stored.attrs["count"] == len(variables) > 0
            for index, variable in enumerate(variables):
                assert stored[f"{index:05d}"].attrs["path"] == variable.path
                np.testing.assert_array_equal(stored[f"{index:05d}"][()], variable.numpy())
        iterations = handle["optimizer/00000"]
        assert iterations.attrs["path"].endswith("iteration") and iterations[()] == 4


def test_can_load_rejects_foreign_and_incomplete_files(trained, tmp_path):
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5")
    keras_weights = tmp_path / "model.weights.h5"
    trained.save_weights(keras_weights)
    ours = H5Backend().save(trained, tmp_path / "ours")
    no_mark = tmp_path / "no-mark.h5"
    no_mark.write_bytes(ours.read_bytes())
    with h5py.File(no_mark, "r+") as handle:
        del handle["metadata"]
    assert H5Backend.can_load(ours)
    # A file of ours that lost its metadata is damaged, not foreign: its user-block manifest
    # claims it without HDF5 parsing it (libhdf5 can hang on damage), and the load refuses
    # it by its manifest (h5py rewrote it smaller).
    assert H5Backend.can_load(no_mark)
    with pytest.raises(CorruptCheckpointError, match="bytes instead of"):
        H5Backend().load(no_mark)
    for path in (text, keras_weights, tmp_path):
        assert not H5Backend.can_load(path), path
        with pytest.raises(NotACheckpointError):
            H5Backend().load(path)
    assert detect_backend(ours) is H5Backend
    with pytest.raises(NotACheckpointError, match="not a checkpoint in any registered format"):
        load_checkpoint(keras_weights)


def test_unregistered_class_is_named_and_custom_objects_fix_it(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, Doubler()(keras.layers.Dense(2)(inputs)))
    path = H5Backend().save(model, tmp_path / "custom")
    registered = keras.saving.get_custom_objects()
    saved = registered.pop("test_h5>Doubler")
    try:
        with pytest.raises(MissingClassError, match="uses 'test_h5>Doubler', which is not"):
            H5Backend().load(path)
        restored = H5Backend().load(path, custom_objects={"test_h5>Doubler": Doubler}).model
    finally:
        registered["test_h5>Doubler"] = saved
    x = np.ones((2, 3), "float32")
    np.testing.assert_array_equal(restored.predict(x, verbose=0), model.predict(x, verbose=0))


def test_stored_lambda_needs_safe_mode_false(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Lambda(lambda t: t * 3.0)(inputs))
    path = H5Backend().save(model, tmp_path / "lambda")
    with pytest.raises(MissingClassError, match="safe_mode=False"):
        load_checkpoint(path)
    loaded = load_checkpoint(path, safe_mode=False).model
    x = np.ones((1, 3), "float32")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), x * 3.0)


def test_uncompiled_model_and_compile_false(trained, tmp_path):
    bare = build_model("functional", compiled=False)
    loaded = H5Backend().load(H5Backend().save(bare, tmp_path / "bare")).model
    assert not loaded.compiled
    x, _ = suite_data("functional")
    np.testing.assert_array_equal(bare.predict(x, verbose=0), loaded.predict(x, verbose=0))

    path = H5Backend().save(trained, tmp_path / "trained")
    assert not H5Backend().load(path, compile=False).model.compiled


def test_gzip_compression_round_trips(trained, tmp_path):
    path = H5Backend(compression="gzip").save(trained, tmp_path / "gz")
    with h5py.File(path, "r") as handle:
        layers = handle["layers"]
        first = next(k for k in sorted(layers) if len(layers[k]["arrays"]))
        kernel = layers[first]["arrays/00000"]  # the first Dense layer's kernel
        assert kernel.ndim == 2 and kernel.compression == "gzip"
    loaded = load_checkpoint(path).model
    x, _ = suite_data("sequential")
    np.testing.assert_array_equal(trained.predict(x, verbose=0), loaded.predict(x, verbose=0))


def test_newer_format_version_is_refused(trained, tmp_path):
    path = H5Backend().save(trained, tmp_path / "future")
    with h5py.File(path, "r+") as handle:
        metadata = json.loads(handle["metadata"].asstr()[()])
        del handle["metadata"]
        handle["metadata"] = json.dumps({**metadata, "format_version": 99})
    reseal(path)  # as a newer trainer would have written it: a valid manifest
    with pytest.raises(IncompatibleFormatError, match="format version 99"):
        load_checkpoint(path)


def test_bfloat16_variables_keep_their_dtype(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")])
    model.compile("sgd", "mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 3), "float32"), verbose=0)
    loaded = load_checkpoint(H5Backend().save(model, tmp_path / "bf16")).model
    for saved, restored in zip(model.weights, loaded.weights, strict=True):
        assert restored.dtype == saved.dtype == "bfloat16"
        np.testing.assert_array_equal(restored.numpy(), saved.numpy())
