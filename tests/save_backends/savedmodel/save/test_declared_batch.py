"""A Functional model on one unbatched image (``keras.Input(batch_shape=(h, w, c))``, as
Keras' RandomCrop test builds it) saves through savedmodel and loads computing the same.

Before: the serving trace always freed the first dimension, so RandomCrop got a rank-3
input of unknown height and the save was refused ("could not be traced for serving"),
although the model runs in a tf.function on the shape it declares. Now the declared first
dimension is used when, and only when, the free one cannot be traced.
"""

from __future__ import annotations

import keras
import numpy as np

from trainer.save_backends import get_backend


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
