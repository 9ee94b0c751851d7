"""A Functional model on one unbatched image (``keras.Input(batch_shape=(h, w, c))``, as
Keras' RandomCrop test builds it) saves through savedmodel and loads computing the same.

Before: the serving trace always freed the first dimension, so RandomCrop got a rank-3
input of unknown height and the save was refused ("could not be traced for serving"),
although the model runs in a tf.function on the shape it declares. Now the declared first
dimension (a subclassed model's: the shape it was built on) is used when, and only when,
the free one cannot be traced.
"""

from __future__ import annotations

import keras
import numpy as np

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend, load_checkpoint


def test_an_unbatched_image_model_saves_and_crops_alike(tmp_path):
    keras.utils.set_random_seed(1)
    image = keras.Input(batch_shape=(8, 8, 3))
    model = keras.Model(image, keras.layers.RandomCrop(4, 4, name="crop")(image))
    x = np.random.default_rng(0).normal(size=(8, 8, 3)).astype("float32")
    path = get_backend("savedmodel").save(model, tmp_path / "crop")
    loaded = get_backend("savedmodel").load(path).model
    for training in (True, False):  # from the same generator state: the same crop
        expected, got = model(x, training=training), loaded(x, training=training)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert tuple(np.asarray(loaded(x, training=True)).shape) == (4, 4, 3)


@keras.saving.register_keras_serializable(zoo.PKG)
class CropModel(keras.Model):
    """The same crop in a subclassed model, built by one call on one unbatched image."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.crop = keras.layers.RandomCrop(4, 4, name="crop")

    def call(self, x, training=None):
        return self.crop(x, training=training)


def test_an_unbatched_image_subclassed_model_revives_and_crops_alike(tmp_path):
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(0).normal(size=(8, 8, 3)).astype("float32")
    model = CropModel(name="crop_model")
    model(x)
    path = get_backend("savedmodel").save(model, tmp_path / "crop")
    with zoo.classes_hidden(["CropModel"]):
        loaded = load_checkpoint(path)
    assert loaded.metadata["revived_from"]["crop_model"] == "traced"
    for training in (True, False):
        expected, got = model(x, training=training), loaded.model(x, training=training)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
