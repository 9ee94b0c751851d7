"""Input dtypes a layer revived from its traces must take, and the dtypes a model is served
with (issue 42, item 3; issue 38, item 3).

Keras' preprocessing layers (``TFDataLayer``: ``RandomShear``...) convert their inputs to
their compute dtype in ``__call__`` when called inside a TF graph, before ``call``. The save
traced such a layer with what its ``call`` received (float32), while the model fed it
int64 images: a load that rebuilt the Functional graph around the revived layer fed it
int64 and failed with ``CorruptCheckpointError`` ("Could not find matching concrete
function ... int64"). ``RandomShear`` is one Keras cannot rebuild from its own config, so
it always comes back from its traces.

A subclassed model on integer ids whose first use of them is no cast (``ops.take``,
``tf.gather``, ``ops.one_hot``): Keras types its inputs as floats (it records no dtype for
the calls of a subclassed model). Rows gathered by ids could not be traced on floats at
all, so the save failed with ``ModelNotReadyError``; ``one_hot`` casts floats to int64, so
it was served and traced for int64 only, and its revival refused the int32 ids the model
was called with.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

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


class IdTable(keras.layers.Layer):  # not registered: revived from its traces
    """Rows of a table gathered by integer ids, averaged (an embedding written by hand)."""

    def build(self, shape):
        self.table = self.add_weight(shape=(20, 3), name="table")

    def call(self, ids):
        return keras.ops.mean(keras.ops.take(self.table, ids, axis=0), axis=1)


class GatherIds(keras.Model):  # not registered: revived from its traces
    def __init__(self, declare_ids=False, **kwargs):
        super().__init__(**kwargs)
        self.rows = IdTable(name="rows")
        self.head = keras.layers.Dense(2, name="head")
        if declare_ids:
            self.input_spec = keras.InputSpec(dtype="int32", ndim=2)

    def call(self, ids):
        return self.head(self.rows(ids))


class OneHotIds(keras.Model):  # not registered: revived from its traces
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = keras.layers.Dense(2, name="head")

    def call(self, ids):
        return self.head(keras.ops.sum(keras.ops.one_hot(ids, 20), axis=1))


_MODELS = {
    "gather": GatherIds,
    "gather_input_spec": lambda: GatherIds(declare_ids=True),
    "one_hot": OneHotIds,
}


@pytest.fixture(scope="module", params=list(_MODELS))
def ids_round_trip(request, tmp_path_factory):
    """The model called on int32 ids (never fit), saved and loaded through savedmodel."""
    keras.utils.set_random_seed(5)
    model = _MODELS[request.param]()
    ids = np.random.default_rng(2).integers(0, 20, (4, 5)).astype("int32")
    model(ids)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    backend = get_backend("savedmodel")
    path = backend.save(model, tmp_path_factory.mktemp(request.param) / "ckpt")
    return model, path, backend.load(path), ids


def test_a_subclassed_model_on_ids_is_served_with_integer_ids(ids_round_trip):
    model, path, _, ids = ids_round_trip
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    (spec,) = served.structured_input_signature[1].values()
    assert spec.dtype.is_integer  # was float32, or no save at all
    if not isinstance(model, OneHotIds):  # one_hot casts to int64: served as that
        assert spec.dtype == tf.int32
    (out,) = served(tf.constant(ids, spec.dtype)).values()
    np.testing.assert_allclose(out.numpy(), model(ids).numpy(), atol=1e-6)


def test_its_revival_takes_int32_and_int64_ids_and_trains_alike(ids_round_trip):
    model, _, checkpoint, ids = ids_round_trip
    revived = checkpoint.model
    assert checkpoint.metadata["revived_from"][model.name] == "traced"  # its class missing
    expected = model(ids).numpy()
    widths = ["int32"] if model.input_spec is not None else ["int32", "int64"]  # as declared
    for dtype in widths:
        np.testing.assert_allclose(revived(ids.astype(dtype)).numpy(), expected, atol=1e-6)
    labels = np.random.default_rng(3).normal(size=(4, 2)).astype("float32")
    for each in (model, revived):
        each.fit(ids, labels, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert len(model.weights) == len(revived.weights)
    for a, b in zip(model.weights, revived.weights, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(b), keras.ops.convert_to_numpy(a), atol=1e-6
        )


class Squares(keras.layers.Layer):  # not registered: revived from its traces
    def call(self, x):
        return x * x


def test_a_revived_layer_that_does_not_autocast_takes_the_float64_it_was_fed(tmp_path):
    """``autocast=False``: the original's ``call`` got the model's float64 and was traced
    on it; the stand-in autocast to float32, which no trace took (the load failed)."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((3,), dtype="float64")
    squared = Squares(autocast=False, name="squares")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(squared))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(4).normal(size=(4, 3))
    labels = np.random.default_rng(5).normal(size=(4, 2)).astype("float32")
    backend = get_backend("savedmodel")
    checkpoint = backend.load(backend.save(model, tmp_path / "ckpt"))
    revived = checkpoint.model
    assert checkpoint.metadata["revived_from"]["squares"] == "traced"
    assert revived.get_layer("squares").autocast is False
    np.testing.assert_allclose(revived(x).numpy(), model(x).numpy(), atol=1e-6)
    for each in (model, revived):
        each.fit(x, labels, batch_size=4, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.weights, revived.weights, strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(b), keras.ops.convert_to_numpy(a), atol=1e-6
        )
