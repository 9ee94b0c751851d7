"""Input dtypes a layer revived from its traces must take (issue 42, item 3).

Keras' preprocessing layers (``TFDataLayer``: ``RandomShear``...) convert their inputs to
their compute dtype in ``__call__`` when called inside a TF graph, before ``call``. The save
traced such a layer with what its ``call`` received (float32), while the model fed it
int64 images: a load that rebuilt the Functional graph around the revived layer fed it
int64 and failed with ``CorruptCheckpointError`` ("Could not find matching concrete
function ... int64"). ``RandomShear`` is one Keras cannot rebuild from its own config, so
it always comes back from its traces.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.save_backends import get_backend


@pytest.fixture(scope="module")
def shear_round_trip(tmp_path_factory):
    """A Sequential model on int64 images (RandomShear, then a Dense head), trained one
    step, saved and loaded through savedmodel."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3), dtype="int64"),
            keras.layers.RandomShear(0.2, 0.2, seed=1, name="shear"),
            keras.layers.Flatten(),
            keras.layers.Dense(2, name="head"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    images = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3)).astype("int64")
    labels = np.random.default_rng(1).normal(size=(4, 2)).astype("float32")
    model.fit(images, labels, batch_size=4, epochs=1, verbose=0)
    backend = get_backend("savedmodel")
    path = backend.save(model, tmp_path_factory.mktemp("shear") / "ckpt")
    return model, backend.load(path), images, labels


def test_a_revived_preprocessing_layer_takes_the_integer_images_the_model_feeds(
    shear_round_trip,
):
    model, checkpoint, images, _ = shear_round_trip
    revived = checkpoint.model
    assert checkpoint.metadata["revived_from"]["shear"] == "traced"  # not rebuilt by Keras
    expected = model.predict(images, verbose=0)
    np.testing.assert_allclose(revived.predict(images, verbose=0), expected, atol=1e-5)
    # The layer itself, called eagerly on the model's int64 images (no graph around it).
    layer = revived.get_layer("shear")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(layer(images, training=False)),
        keras.ops.convert_to_numpy(model.get_layer("shear")(images, training=False)),
        atol=1e-5,
    )


def test_a_revived_preprocessing_layer_trains_alike_on_integer_images(shear_round_trip):
    """One training step on both: the random shear draws from the same restored seed
    state, so the head's weights move alike."""
    model, checkpoint, images, labels = shear_round_trip
    revived = checkpoint.model
    for each in (model, revived):
        each.fit(images, labels, batch_size=4, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.weights, revived.weights, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(b), keras.ops.convert_to_numpy(a), atol=1e-5
        )
