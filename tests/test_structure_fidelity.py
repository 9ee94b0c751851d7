"""Model structures a checkpoint must give back as they were (found by a probe of model
structures through every backend)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.save_backends import get_backend

BACKENDS = ("savedmodel", "h5", "weights")
RNG = np.random.default_rng(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dict_outputs_keep_their_order(backend, tmp_path):
    """Configs were stored with sorted keys: outputs {"zout", "aout"} came back as
    ["aout", "zout"], and the per-output losses evaluate reports were swapped."""
    keras.utils.set_random_seed(0)
    zeta, alpha = keras.Input((3,), name="zeta"), keras.Input((2,), name="alpha")
    joined = keras.layers.Concatenate()([zeta, alpha])
    outputs = {
        "zout": keras.layers.Dense(3, name="zout")(joined),
        "aout": keras.layers.Dense(2, name="aout")(joined),
    }
    model = keras.Model({"zeta": zeta, "alpha": alpha}, outputs)
    model.compile("adam", {"zout": "mse", "aout": "mae"})
    x = {"zeta": RNG.normal(size=(8, 3)), "alpha": RNG.normal(size=(8, 2))}
    y = {"zout": np.zeros((8, 3)), "aout": np.ones((8, 2))}
    model.train_on_batch(x, y)
    loaded = get_backend(backend).load(get_backend(backend).save(model, tmp_path / "c")).model
    assert list(loaded(x)) == ["zout", "aout"]
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
