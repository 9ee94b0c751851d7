"""A value a layer's config holds can change between two saves of one model: a schedule
lowering ``Dropout.rate``, a ``Discretization`` adapted again. The second checkpoint must
hold the new value. Found by a probe: the savedmodel trace cache reused the first save's
records (its fingerprint read no config), and the async shadow, rebuilt from the config
once, kept the old values with every backend (a re-adapted Discretization predicted up to
3.8 off after the load)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.model_state.config_check import held_values
from trainer.save_backends import load_checkpoint


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_a_value_changed_between_saves_is_in_the_second_checkpoint(tmp_path, backend, async_save):
    rng = np.random.default_rng(0)
    first, second = rng.normal(size=(64, 4)), rng.normal(loc=3.0, size=(64, 4))
    bins = keras.layers.Discretization(num_bins=4)
    bins.adapt(first.astype("float32"))
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dropout(0.5), bins]
    )
    model.compile("adam", "mse")
    policy = CheckpointPolicy(async_save=async_save, keep_best=0)
    with CheckpointManager(tmp_path / "run", backend=backend, policy=policy) as manager:
        manager.save(model)
        manager.wait()
        model.layers[1].rate = 0.1
        bins.adapt(second.astype("float32"))
        model.optimizer.iterations.assign_add(1)
        manager.save(model)
        manager.wait()
        loaded = load_checkpoint(manager.latest()).model
    assert loaded.layers[1].rate == 0.1
    assert loaded.layers[2].bin_boundaries == bins.bin_boundaries
    x = rng.normal(loc=1.5, size=(16, 4)).astype("float32")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_held_values_are_the_config_entries_kept_as_plain_attributes():
    layer = keras.layers.Dropout(0.25, seed=3)
    assert dict(held_values(layer)) == {"rate": 0.25, "seed": 3, "noise_shape": None}
    layer.rate = 0.5
    assert dict(held_values(layer))["rate"] == 0.5
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert held_values(model) == ()  # a graph's config is its layers'
