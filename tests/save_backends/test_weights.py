"""What is specific to the ``weights`` backend: Keras interop and loading into a model."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from trainer.errors import ConfigMismatchError, NotACheckpointError
from trainer.save_backends import detect_backend
from trainer.save_backends.weights import WeightsBackend
from trainer.state import TrainingState
from trainer.testing import SuiteSubclassed, build_model, suite_data, train


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build_model("subclassed")
    train(model, "subclassed")
    directory = tmp_path_factory.mktemp("weights")
    path = WeightsBackend().save(model, directory / "ckpt", state=TrainingState(epoch=1))
    return model, path


def test_directory_layout_and_plain_keras_can_read_the_weights(saved):
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == [
        "model.weights.h5",
        "optimizer.h5",
        "trainer.json",
        "trainer_manifest.json",  # sizes and digests of the others (trainer.storage.integrity)
    ]
    index = json.loads((path / "trainer.json").read_text())
    assert index["format"] == "trainer-weights"
    assert index["model_config"]["registered_name"] == "trainer_testing>SuiteSubclassed"
    assert index["training_state"]["epoch"] == index["metadata"]["state"]["epoch"] == 1

    fresh = SuiteSubclassed()  # Keras alone, no trainer code, reads model.weights.h5
    x, _ = suite_data("subclassed")
    fresh(x[:1])
    fresh.load_weights(path / "model.weights.h5")
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))


def test_load_into_an_unbuilt_existing_model(saved):
    model, path = saved
    target = SuiteSubclassed()
    checkpoint = WeightsBackend().load(path, model=target)
    assert checkpoint.model is target and target.built and target.compiled
    assert int(target.optimizer.iterations) == int(model.optimizer.iterations) == 4
    x, y = suite_data("subclassed")
    np.testing.assert_array_equal(target.predict(x, verbose=0), model.predict(x, verbose=0))
    assert target.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)


def test_compile_false_keeps_the_existing_models_own_compile(saved):
    _, path = saved
    target = SuiteSubclassed()
    target.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    # Keras' load_weights sees the saved Adam slots and skips them for this SGD, loudly.
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        WeightsBackend().load(path, model=target, compile=False)
    assert isinstance(target.optimizer, keras.optimizers.SGD)
    assert int(target.optimizer.iterations) == 0


def test_mismatched_architecture_is_refused(saved):
    _, path = saved
    wrong = SuiteSubclassed(units=5)
    with pytest.raises(ConfigMismatchError, match="do not fit"):
        WeightsBackend().load(path, model=wrong)


def test_can_load_needs_the_index_and_both_files(saved, tmp_path):
    _, path = saved
    assert detect_backend(path) is WeightsBackend
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "model.weights.h5").write_bytes((path / "model.weights.h5").read_bytes())
    (partial / "optimizer.h5").write_bytes((path / "optimizer.h5").read_bytes())
    assert not WeightsBackend.can_load(partial)  # no trainer.json: never completed
    (partial / "trainer.json").write_text(json.dumps({"format": "something-else"}))
    assert not WeightsBackend.can_load(partial)
    assert not WeightsBackend.can_load(path / "model.weights.h5")
    with pytest.raises(NotACheckpointError):
        WeightsBackend().load(partial)
