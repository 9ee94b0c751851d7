"""Keras layers whose ``get_config()`` holds one of their own tracked lists round-trip
through the config-rebuilding backends (h5, weights).

Before: Keras 3.15's ``RandomBrightness`` (and ``RandomColorDegeneration``,
``RandomPosterization``, ``RandomSaturation``, ``RandomSharpness``, ``Solarization``)
returns its ``value_range`` attribute, a Keras tracked list holding a reference to the
layer's tracker, in its config. ``config_check.refuse_unrebuildable`` deep-copied the
config to try rebuilding it, the copy failed on a module object, and h5 and weights
refused the save ("cannot be rebuilt from its get_config()"), although Keras's own
``.keras`` save writes the list and loads it back. Found by Keras's layer tests run through
trainer (issue 38). Now the check copies the config as a load gets it: plain lists.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.save_backends import get_backend


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.RandomBrightness(0.3, value_range=(0, 255), seed=5, name="bright")(inputs)
    outputs = keras.layers.Dense(2, name="head")(keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_a_layer_whose_config_holds_its_tracked_list_round_trips(tmp_path, backend):
    model = _model()
    x = np.random.default_rng(0).uniform(0, 255, size=(3, 4, 4, 3)).astype("float32")
    y = np.zeros((3, 2), "float32")
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    loaded = get_backend(backend).load(path).model
    assert type(loaded.get_layer("bright")) is keras.layers.RandomBrightness
    assert list(loaded.get_layer("bright").value_range) == [0, 255]
    np.testing.assert_allclose(loaded(x, training=False), model(x, training=False), atol=1e-5)
    losses = [m.train_on_batch(x, y) for m in (model, loaded)]  # brightness drawn alike
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
