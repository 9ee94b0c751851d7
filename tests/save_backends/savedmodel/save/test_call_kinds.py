"""A subclassed model called on sparse or ragged tensors, on integer ids in several inputs,
or on 16-bit integer images revives without its class taking what it was called on, and
computes and trains as the original does.

Before: Keras records only the shapes of a subclassed model's calls, so the model was
traced on dense float32 specs only (plus int64/int32 for models of converting layers): its
class-missing revival refused the sparse or ragged tensors (``RevivedCallError``) and the
int16 images it was built on, and a model crossing two id inputs (``HashedCrossing``)
could not be saved at all ("could not be traced for serving"). Found by Keras's layer tests
run through trainer (issue 38; ``tests/peer/layer_expectations.json``). Now the save also
traces the sparse and ragged forms of the served inputs, every float input as ids at once
when one at a time fails, and the integer widths images and audio are stored in, keeping
each where the model's own code traces on it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend, load_checkpoint


def _wrapper(name: str, make_inner):
    """A registered subclassed model ``name`` whose ``call`` hands its input to one layer."""

    class Wrapper(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = make_inner()

        def call(self, inputs):
            return self.inner(inputs)

    Wrapper.__name__ = Wrapper.__qualname__ = name
    return keras.saving.register_keras_serializable(zoo.PKG)(Wrapper)


SPARSE = tf.SparseTensor([[0, 0], [1, 2], [2, 1]], [1.0, 2.0, -3.0], [3, 4])
RAGGED = tf.ragged.constant([[1, 2, 3], [4], [0, 5]])
CASES = {
    "sparse_dense": (lambda: keras.layers.Dense(2), SPARSE),
    "ragged_embedding": (lambda: keras.layers.Embedding(6, 2), RAGGED),
    "crossed_ids": (
        lambda: keras.layers.HashedCrossing(num_bins=5, output_mode="one_hot"),
        (np.array([1, 2, 3]), np.array([4, 5, 4])),
    ),
    # Passes a sparse input through in inference, fails on it in training: its sparse
    # inference trace must not be kept (the save then failed tracing it for training).
    "augmentation_on_dense": (
        lambda: keras.layers.RandomBrightness(0.2, seed=1),
        np.linspace(0, 1, 48, dtype="float32").reshape(1, 4, 4, 3),
    ),
    "int16_images": (
        lambda: keras.layers.Rescaling(1 / 255, offset=0.5),
        np.arange(18, dtype="int16").reshape(3, 2, 3),
    ),
    # A width no model is tried on without a record of its calls (``call_records``): traced
    # because the model was called on it. Before the record, its revival refused uint16.
    "uint16_images": (
        lambda: keras.layers.Rescaling(1 / 255),
        np.arange(18, dtype="uint16").reshape(3, 2, 3),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def revived(request, tmp_path_factory):
    """(original, revived without its class, input) of one case."""
    make_inner, data = CASES[request.param]
    name = "KindsOf_" + request.param
    cls = _wrapper(name, make_inner)
    keras.utils.set_random_seed(0)
    model = cls(name=request.param)
    model(data)
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("ckpt") / "c")
    with zoo.classes_hidden([name]):
        loaded = load_checkpoint(path, compile=False)
    assert loaded.metadata["revived_from"][request.param] == "traced"
    return model, loaded.model, data


def _dense(value) -> np.ndarray:
    if isinstance(value, tf.SparseTensor):
        value = tf.sparse.to_dense(value)
    if isinstance(value, tf.RaggedTensor):
        value = value.to_tensor()
    return np.asarray(value)


def test_the_revived_model_takes_what_the_original_was_called_on(revived):
    model, loaded, data = revived
    expected, got = model(data), loaded(data)
    assert type(got) is type(expected)
    assert _dense(got).dtype == _dense(expected).dtype
    np.testing.assert_allclose(_dense(got), _dense(expected), rtol=1e-6, atol=1e-6)


def test_one_training_step_moves_the_revived_model_alike(revived):
    model, loaded, data = revived
    if not model.trainable_weights:
        pytest.skip("no trainable weights: nothing to train")
    if isinstance(model(data), tf.RaggedTensor):
        pytest.skip("ragged outputs: Keras's fit cannot train the original on them either")
    target = np.zeros_like(_dense(model(data)))
    losses = []
    for each in (model, loaded):
        each.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses.append(each.train_on_batch(data, target))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    assert len(loaded.weights) == len(model.weights)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)


class PerRow(keras.Model):
    """Maps its Dense over the rows with ``tf.map_fn``: on the sparse rows the save tries,
    its ``fn`` fails inside ``map_fn``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def build(self, input_shape):
        self.dense.build((None, input_shape[-1]))

    def call(self, inputs):
        return tf.map_fn(lambda row: self.dense(row[None])[0], inputs)


def test_the_saves_failed_tries_leave_the_process_as_it_was(tmp_path):
    """A failed try inside ``tf.map_fn`` left a caching device on the process's variable
    scope: every later ``tf.distribute`` scope then failed half-entered, and every later
    ``fit`` of the process with it (``colocate_vars_with``), so one save broke the rest of
    the user's program."""
    scope = tf.compat.v1.get_variable_scope()
    model = PerRow()
    # Built, never called: no record of what it was called on, so the save tries the
    # sparse rows (a model called on dense rows only is never tried on them).
    model.build((None, 3))
    try:
        get_backend("savedmodel").save(model, tmp_path / "ckpt")
        assert scope.caching_device is None
        with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
            other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            other.compile("sgd", "mse")
        other.fit(np.ones((4, 3)), np.ones((4, 1)), epochs=1, verbose=0)
    finally:  # a failure here must not break the other tests of this worker
        with tf.compat.v1.get_default_graph().as_default():
            scope.set_caching_device(None)
