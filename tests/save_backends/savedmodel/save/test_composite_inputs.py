"""Issue 14, defect 26: ragged and sparse inputs through the SavedModel backend.

Every layer's call functions used to be traced with dense ``TensorSpec``s, so a model
whose custom layer takes a ``tf.RaggedTensor`` or ``tf.SparseTensor`` could not be saved
(the serving trace fed the layer a dense tensor), and a layer revived from its traces
could not be called with the kind of tensor the original took. Each model here is
checked with its class known (bitwise), with its class missing (within 1e-5, both
``training`` values, one optimizer step), and through the SavedModel's own endpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

from tests.helpers import savedmodel_zoo as zoo
from trainer.errors import TrainerError
from trainer.save_backends import get_backend, load_checkpoint

register = keras.saving.register_keras_serializable(zoo.PKG)


@register
class CiRaggedPool(layers.Layer):
    """Scales a ragged row, sums it and appends the row's length; training doubles the
    scaled values (deterministic, so both traces can be compared exactly)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")
        self.shift = self.add_weight(shape=(), initializer="zeros", name="shift")

    def call(self, x, training=None):
        scaled = x * self.scale + self.shift
        if training:
            scaled = scaled * 2.0
        total = tf.reduce_sum(scaled, axis=1)
        return tf.stack([total, tf.cast(x.row_lengths(), total.dtype)], axis=1)

    def compute_output_shape(self, shape):
        return (shape[0], 2)


@register
class CiSparseProject(layers.Layer):
    """A sparse-times-dense product (only a ``tf.SparseTensor`` has ``indices``); training
    adds a constant offset."""

    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")

    def call(self, x, training=None):
        assert isinstance(x, tf.SparseTensor), type(x)
        out = tf.sparse.sparse_dense_matmul(x, self.kernel)
        return out + 1.0 if training else out

    def compute_output_shape(self, shape):
        return (shape[0], self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _ragged(seed=0, rows=8):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, size=rows)
    return tf.ragged.constant([rng.normal(size=n).astype("float32").tolist() for n in lengths])


def _sparse(seed=0, rows=8, width=6):
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(rows, width)).astype("float32")
    dense[rng.random(size=dense.shape) < 0.6] = 0.0
    return tf.sparse.from_dense(dense)


def _targets(seed=1, rows=8):
    return np.random.default_rng(seed).normal(size=(rows, 2)).astype("float32")


def ragged_model():
    inputs = keras.Input(shape=(None,), ragged=True, name="tokens")
    model = keras.Model(inputs, layers.Dense(2)(CiRaggedPool(name="pool")(inputs)), name="rag")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def sparse_model():
    inputs = keras.Input(shape=(6,), sparse=True, name="features")
    hidden = CiSparseProject(3, name="project")(inputs)
    model = keras.Model(inputs, layers.Dense(2)(hidden), name="spa")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


CASES = {
    "ragged": (ragged_model, _ragged, "CiRaggedPool"),
    "sparse": (sparse_model, _sparse, "CiSparseProject"),
}


def _one_step(model, x, y):
    dataset = tf.data.Dataset.from_tensors((x, y))
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)


def _check(model, loaded, x, y, *, exact):
    """Same outputs in both training modes, and one optimizer step moves the weights the
    same way (exactly with the class known, within 1e-5 from traces)."""
    compare = (
        np.testing.assert_array_equal
        if exact
        else (lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5))
    )
    for training in (False, True):
        compare(loaded(x, training=training).numpy(), model(x, training=training).numpy())
    assert not np.allclose(model(x, training=True), model(x, training=False))
    before = [v.numpy() for v in loaded.trainable_variables]
    for m in (model, loaded):
        _one_step(m, x, y)
    after = [v.numpy() for v in loaded.trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert len(model.trainable_variables) == len(loaded.trainable_variables)
    for a, b in zip(model.trainable_variables, loaded.trainable_variables, strict=True):
        compare(b.numpy(), a.numpy())


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("hidden", [False, True], ids=["class_known", "class_missing"])
def test_composite_input_model_round_trips(tmp_path, kind, hidden):
    """(a) ragged / (c) sparse with the class missing: revived from traces that take the
    same kind of tensor; (b) with the class known: rebuilt from config, bitwise."""
    make, data, class_name = CASES[kind]
    model = make()
    x, y = data(), _targets()
    _one_step(model, x, y)  # trained: optimizer state exists
    saved = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with zoo.classes_hidden([class_name] if hidden else []):
        checkpoint = load_checkpoint(saved)
        loaded = checkpoint.model
        layer = loaded.layers[1]
        assert checkpoint.metadata["revived_from"][layer.name] == ("traced" if hidden else "config")
        assert type(layer).__name__ == class_name
        _check(model, loaded, x, y, exact=not hidden)
        # a second save of the loaded model, and its load, still takes the same tensors
        again = load_checkpoint(get_backend("savedmodel").save(loaded, tmp_path / "again"))
        np.testing.assert_allclose(again.model(x), loaded(x), atol=1e-5)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_serving_endpoints_of_a_composite_input_model(tmp_path, kind):
    """``serve`` takes the composite tensor itself; the ``serving_default`` signature
    (dense tensors only, as TF Serving feeds them) takes its components, named
    ``<input>_values`` / ``_row_splits`` or ``_indices`` / ``_values`` / ``_dense_shape``."""
    make, data, _ = CASES[kind]
    model = make()
    x = data()
    expected = model(x, training=False).numpy()
    saved = Path(get_backend("savedmodel").save(model, tmp_path / "ckpt"))
    plain = tf.saved_model.load(str(saved))
    np.testing.assert_allclose(plain.serve(x).numpy(), expected, atol=1e-6)
    signature = plain.signatures["serving_default"]
    if kind == "ragged":
        feed = {"tokens_values": x.values, "tokens_row_splits": x.row_splits}
    else:
        feed = {
            "features_indices": x.indices,
            "features_values": x.values,
            "features_dense_shape": x.dense_shape,
        }
    (output,) = signature(**feed).values()
    np.testing.assert_allclose(output.numpy(), expected, atol=1e-6)
    metadata = json.loads((saved / "assets.extra" / "trainer_metadata.json").read_text())
    metadata = metadata["savedmodel"]["signature"]
    assert [entry["name"] for entry in metadata["inputs"]] == sorted(feed, key=list(feed).index)
    assert metadata["composite_inputs"][0]["kind"] == kind


def test_revived_layer_refuses_another_ragged_rank_clearly(tmp_path):
    """A stand-in traced on ragged rows refuses a dense tensor with a TrainerError that
    names the layer and what it was traced with, not a raw TensorFlow error."""
    model = ragged_model()
    model(_ragged())
    saved = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with zoo.classes_hidden(["CiRaggedPool"]):
        pool = load_checkpoint(saved).model.get_layer("pool")
        np.testing.assert_allclose(pool(_ragged()), model.get_layer("pool")(_ragged()), atol=1e-6)
        refusal = (
            r"(?s)'pool'.*takes \[ragged \(ragged_rank 1\)"
            r".*input 0 is dense, where it takes ragged.*Received"
        )
        with pytest.raises(TrainerError, match=refusal):
            pool(tf.zeros((2, 3)))


class CiRaggedSubclassed(keras.Model):
    """A subclassed model called on ragged rows: Keras records only their shapes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pool = CiRaggedPool()

    def call(self, x):
        return self.pool(x)


def test_subclassed_model_on_ragged_rows_is_refused_at_save_time(tmp_path):
    """Keras keeps no record that a subclassed model's input was ragged, so its serving
    trace cannot be rebuilt: the save is refused, saying how to make it saveable."""
    model = CiRaggedSubclassed(name="sub")
    model(_ragged())
    with pytest.raises(TrainerError, match=r"(?s)ragged or sparse.*keras\.Input.*Received"):
        get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@register
class CiDenseToRagged(keras.Model):
    """A subclassed model on dense rows that makes them ragged (zeros dropped) for its
    ragged-only layer: the model's input is dense, its sublayer's is not."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pool = CiRaggedPool(name="inner_pool")
        self.head = layers.Dense(2)

    def call(self, x, training=None):
        rows = tf.RaggedTensor.from_tensor(x, padding=0.0)
        return self.head(self.pool(rows, training=training))


def test_inner_layer_fed_ragged_rows_revives_taking_ragged_rows(tmp_path):
    """The ragged tensor is made inside the model: the sublayer revived from its traces
    (class missing) is called on ragged rows after the load, in both training modes."""
    model = CiDenseToRagged(name="inner")
    x = _ragged().to_tensor()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x, _targets(), epochs=1, batch_size=8, verbose=0, shuffle=False)
    saved = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with zoo.classes_hidden(["CiRaggedPool", "CiDenseToRagged"]):
        checkpoint = load_checkpoint(saved)
        loaded = checkpoint.model
        assert checkpoint.metadata["revived_from"]["inner_pool"] == "traced"
        rows = _ragged(3)
        for training in (False, True):
            np.testing.assert_allclose(
                loaded.pool(rows, training=training),
                model.pool(rows, training=training),
                atol=1e-5,
            )
        _check(model, loaded, x, _targets(), exact=False)


def test_export_of_a_ragged_model_serves_and_refuses_warmup(tmp_path):
    """An export (trainer's SavedModel) of a ragged-input model serves through its
    component signature; warmup examples, which cannot be cut per example from ragged
    components, are refused before anything is written."""
    from trainer.exports.exporter import export_serving

    model = ragged_model()
    x = _ragged()
    with pytest.raises(TrainerError, match=r"(?s)ragged or sparse.*without warmup.*Received"):
        export_serving(model, tmp_path / "export", warmup=x.to_tensor().numpy())
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())
    version = export_serving(model, tmp_path / "export", format="savedmodel")
    signature = tf.saved_model.load(str(version)).signatures["serving_default"]
    (output,) = signature(tokens_values=x.values, tokens_row_splits=x.row_splits).values()
    np.testing.assert_allclose(output.numpy(), model(x).numpy(), atol=1e-6)
