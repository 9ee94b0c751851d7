"""A subclassed model of Keras' preprocessing layers, called on integer images, revives
without its class taking those images and computing what the original computes.

Before: Keras records no dtype for a subclassed model's calls, so the model was traced on
float32 only; its class-missing revival refused the int64 images it was built on (found
by the Keras layer peer suite: RandomFlip, RandomTranslation, RandomZoom on int64 data).
Now a model holding a layer that converts whatever dtype it gets is traced on int64 and
int32 inputs too.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend, load_checkpoint


@keras.saving.register_keras_serializable(zoo.PKG)
class FlipAndScale(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.flip = keras.layers.RandomFlip("horizontal", seed=3, name="flip")
        self.scale = keras.layers.Rescaling(1 / 255, name="scale")

    def call(self, x, training=None):
        return self.scale(self.flip(x, training=training))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    keras.utils.set_random_seed(1)
    images = np.random.default_rng(0).integers(0, 255, size=(4, 5, 5, 3))  # int64
    model = FlipAndScale(name="flip_and_scale")
    model(images)
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("ckpt") / "c")
    with zoo.classes_hidden(["FlipAndScale"]):
        loaded = load_checkpoint(path)
    assert loaded.metadata["revived_from"]["flip_and_scale"] == "traced"
    return model, loaded.model, images


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32"])
def test_the_revived_model_takes_integer_images_and_computes_alike(models, dtype):
    model, revived, images = models
    for training in (True, False):  # each call from the same generator state
        expected = model(images.astype(dtype), training=training)
        got = revived(images.astype(dtype), training=training)
        assert got.dtype == expected.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6)
