"""What a layer's own serialization code fails to give is logged and recorded in the
SavedModel's layer record, never dropped silently."""

from __future__ import annotations

import json
import logging

import keras
import numpy as np

from trainer.save_backends import get_backend, load_checkpoint


class NoBuildConfig(keras.layers.Dense):
    def get_build_config(self):
        raise RuntimeError("no build config today")


def test_failing_build_config_is_logged_and_recorded(tmp_path, caplog):
    model = keras.Sequential([keras.Input((3,)), NoBuildConfig(2, name="odd")])
    model.compile(loss="mse")
    with caplog.at_level(logging.WARNING, logger="trainer.save_backends.savedmodel.records"):
        path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert any("no build config today" in r.getMessage() for r in caplog.records)
    meta = json.loads((path / "assets.extra" / "trainer_metadata.json").read_text())
    (record,) = [r for r in meta["savedmodel"]["layers"] if r["name"] == "odd"]
    assert record["build_config"] is None
    assert record["save_fallbacks"] == {"build_config": "RuntimeError: no build config today"}


def test_a_model_saved_with_a_missing_build_config_loads(tmp_path):
    model = keras.Sequential([keras.Input((3,)), NoBuildConfig(2, name="odd")])
    model.compile(loss="mse")
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    x = np.ones((2, 3), "float32")
    loaded = load_checkpoint(path, custom_objects={"NoBuildConfig": NoBuildConfig}).model
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
