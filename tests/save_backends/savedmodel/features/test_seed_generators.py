"""Issue 42, item 1: a layer revived from its traced functions that owns a
``keras.random.SeedGenerator`` comes back with the generator as a generator, not as one
more weight, and with its weights at their saved paths.

Before: the generator's state was wrapped as a plain non-trainable variable, so
``model.weights`` / ``get_weights()`` had one entry more than the original's (an int array
of shape (2,)) and every revived weight lost its layer prefix (``noisy/scale`` became
``scale``): the load succeeded, outputs matched, and code pairing weights by position or by
path went wrong without a word.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend, load_checkpoint

register = keras.saving.register_keras_serializable(zoo.PKG)


@register
class SgNoisy(layers.Layer):
    """Scales its input; adds seeded noise in training (a custom dropout-like layer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x, training=False):
        if training:
            noise = keras.random.normal(keras.ops.shape(x), stddev=0.1, seed=self.seed_generator)
            x = x + noise
        return x * self.scale


@register
class SgModel(keras.Model):
    """A subclassed model holding the noisy layer: both come back from their traces."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noisy = SgNoisy(name="noisy")
        self.head = layers.Dense(2, name="head")

    def call(self, x, training=False):
        return self.head(self.noisy(x, training=training))


def _functional():
    inputs = keras.Input((6,))
    outputs = layers.Dense(2, name="head")(SgNoisy(name="noisy")(inputs))
    return keras.Model(inputs, outputs)


def _subclassed():
    model = SgModel()
    model(np.zeros((1, 6), "float32"))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")


@pytest.mark.parametrize("build", [_functional, _subclassed], ids=["functional", "subclassed"])
def test_a_seed_generator_comes_back_as_a_generator_not_a_weight(tmp_path, build):
    keras.utils.set_random_seed(0)
    original = build()
    original.compile(optimizer="adam", loss="mse")
    x, y = _data()
    original.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    path = get_backend("savedmodel").save(original, tmp_path / "ckpt")
    known = load_checkpoint(path).model
    with zoo.classes_hidden(["SgNoisy", "SgModel"]):
        loaded = load_checkpoint(path)
    revived = loaded.model
    assert loaded.metadata["revived_from"]["noisy"] == "traced", "must exercise traced revival"

    assert [w.path for w in revived.weights] == [w.path for w in original.weights]
    assert len(revived.variables) == len(original.variables)
    assert len(revived.get_weights()) == len(original.get_weights())
    revived.set_weights(original.get_weights())  # pairs by position: must fit as saved
    np.testing.assert_allclose(revived.predict(x, verbose=0), original.predict(x, verbose=0))
    states = [v for v in revived.variables if v.path.endswith("seed_generator_state")]
    assert len(states) == 1 and states[0].path == next(
        v.path for v in original.variables if v.path.endswith("seed_generator_state")
    )
    zoo.assert_trains_alike(known, revived, x, y)
