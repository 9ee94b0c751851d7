"""Issue 14: the SavedModel's ``serve`` endpoint (what ``model.export`` gives servers) and
models whose ``call`` takes several positional tensors (defect 17)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import savedmodel_zoo as zoo
from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.layout import metadata_path


@keras.saving.register_keras_serializable(zoo.PKG)
class PairMix(keras.Model):
    """``call(x, y)`` with inputs of different widths; ``build`` lists y before x, which is
    the order Keras records the shapes in (its export would pass y as x)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dx = keras.layers.Dense(3, name="dx")
        self.dy = keras.layers.Dense(3, name="dy")
        self.drop = keras.layers.Dropout(0.5)

    def build(self, y_shape, x_shape):
        self.dx.build(x_shape)
        self.dy.build(y_shape)

    def call(self, x, y, training=None):
        return {"sum": self.drop(self.dx(x) + self.dy(y), training=training), "x2": x * 2.0}


@keras.saving.register_keras_serializable(zoo.PKG)
class StarDiff(keras.Model):
    """``call(*inputs)``: Keras records the inputs as one tuple."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, name="dense")

    def build(self, input_shape):
        self.dense.build(input_shape[0])

    def call(self, *inputs):
        return self.dense(inputs[0]) - inputs[1][:, :3]


def _inputs(seed=0, n=4):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 5)).astype("float32"),
        rng.normal(size=(n, 7)).astype("float32"),
    )


def _assert_close(got, want, atol=1e-5):
    assert tf.nest.map_structure(lambda _: 0, got) == tf.nest.map_structure(lambda _: 0, want)
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


def _assert_equal(got, want):
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(params=[PairMix, StarDiff], ids=["call_x_y", "call_star_inputs"])
def multi(request, tmp_path):
    keras.utils.set_random_seed(5)
    model = request.param(name=request.param.__name__.lower())
    x, y = _inputs()
    model(x, y)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    return model, path


# ------------------------------------------------------------------ serve, fresh load
@pytest.mark.parametrize("kind", ["sequential_mlp", "two_in_two_out", "shared_layer"])
def test_serve_returns_the_model_outputs_in_a_fresh_load(kind, tmp_path):
    keras.utils.set_random_seed(2)
    model, x, _y, _ = zoo.ZOO[kind]()
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    loaded = tf.saved_model.load(str(path))
    expected = model(x, training=False)
    # the model's own input structure positionally, its own output structure back
    _assert_close(loaded.serve(x), expected)
    half = tf.nest.map_structure(lambda a: a[:5], x)  # another batch size
    _assert_close(loaded.serve(half), model(half, training=False))
    # serving_default is still the named signature
    signature = loaded.signatures["serving_default"]
    assert all(isinstance(v, tf.Tensor) for v in signature(**_named(signature, x)).values())
    if kind == "sequential_mlp":  # TFSMLayer's default endpoint is Keras's "serve"
        np.testing.assert_allclose(keras.layers.TFSMLayer(str(path))(x), expected, atol=1e-5)


def _named(signature, x):
    inputs = signature.structured_input_signature[1]
    if isinstance(x, dict):
        return {k: tf.constant(x[k]) for k in inputs}
    flat = tf.nest.flatten(x)
    return {k: tf.constant(v) for k, v in zip(sorted(inputs), flat, strict=True)}


def test_serve_on_the_fast_path_uses_the_new_weights(tmp_path):
    keras.utils.set_random_seed(4)
    model, x, y, _ = zoo.sequential_mlp()
    backend = get_backend("savedmodel")
    first = backend.save(model, tmp_path / "a")
    before = model(x, training=False)
    model.fit(x, y, epochs=1, verbose=0)  # new weights, same structure: no new trace
    second = backend.save(model, tmp_path / "b")
    assert json.loads(metadata_path(second).read_text())["full_save"] is False
    loaded_first = tf.saved_model.load(str(first))
    loaded_second = tf.saved_model.load(str(second))
    after = model(x, training=False)
    assert not np.allclose(before, after)
    _assert_close(loaded_first.serve(x), before)
    _assert_close(loaded_second.serve(x), after)
    signature = loaded_second.signatures["serving_default"]
    (served,) = signature(**_named(signature, x)).values()
    _assert_close(served, after)


# ---------------------------------------------------------- several positional inputs
def test_multi_input_serving_endpoints(multi):
    model, path = multi
    x, y = _inputs(seed=1)
    expected = model(x, y, training=False)
    loaded = tf.saved_model.load(str(path))
    _assert_close(loaded.serve(x, y), expected)
    _assert_close(loaded.serve(x[:2], y[:2]), model(x[:2], y[:2], training=False))
    signature = loaded.signatures["serving_default"]
    inputs = signature.structured_input_signature[1]
    names = ("x", "y") if isinstance(model, PairMix) else ("input_0", "input_1")
    assert sorted(inputs) == list(names)  # one named input per tensor, call's order
    assert [inputs[n].shape.as_list() for n in names] == [[None, 5], [None, 7]]
    served = signature(**{names[0]: tf.constant(x), names[1]: tf.constant(y)})
    _assert_close(tf.nest.flatten(served), tf.nest.flatten(expected))
    meta = json.loads(metadata_path(path).read_text())["savedmodel"]["signature"]
    assert meta["positional_args"] == 2


def test_multi_input_class_known_is_called_like_the_original(multi):
    model, path = multi
    checkpoint = get_backend("savedmodel").load(path)
    revived = checkpoint.model
    assert type(revived) is type(model)
    assert checkpoint.metadata["revived_from"][model.name] == "config"
    x, y = _inputs(seed=2)
    _assert_equal(revived(x, y, training=False), model(x, y, training=False))


def test_multi_input_class_missing_is_called_like_the_original(multi, tmp_path):
    model, path = multi
    x, y = _inputs(seed=3)
    expected = model(x, y, training=False)
    backend = get_backend("savedmodel")
    with zoo.classes_hidden([type(model).__name__]):
        checkpoint = backend.load(path)
        revived = checkpoint.model
        assert checkpoint.metadata["revived_from"][model.name] == "traced"
        assert type(revived).__module__.startswith("trainer.")
        _assert_close(revived(x, y, training=False), expected)
        with tf.GradientTape() as tape:
            out = revived(x, y, training=True)
            loss = sum(tf.reduce_sum(o) for o in tf.nest.flatten(out))
        grads = tape.gradient(loss, revived.trainable_variables)
        assert revived.trainable_variables and all(g is not None for g in grads)
        if isinstance(model, PairMix):  # the Dropout runs only in training
            train_out = revived(x, y, training=True)["sum"]
            assert not np.allclose(train_out, expected["sum"])
        # saved again without the class: same endpoints, same input names
        again = backend.save(revived, tmp_path / "again")
        reloaded = tf.saved_model.load(str(again))
        _assert_close(reloaded.serve(x, y), expected)
        original = tf.saved_model.load(str(path)).signatures["serving_default"]
        resaved = reloaded.signatures["serving_default"]
        assert resaved.structured_input_signature == original.structured_input_signature
        _assert_close(backend.load(again).model(x, y, training=False), expected)


def test_call_with_inputs_keras_did_not_record_is_refused_at_save(tmp_path):
    class Unrecorded(keras.Model):
        """Default build: Keras records only the first input's shape."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(3)

        def call(self, x, y):
            return self.dense(x) + y

    model = Unrecorded(name="unrecorded")
    x, y = _inputs()
    model(x, y[:, :3])
    with pytest.raises(ModelNotReadyError, match=r"def build\(self, x_shape, y_shape\)"):
        get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert not any(tmp_path.iterdir())
