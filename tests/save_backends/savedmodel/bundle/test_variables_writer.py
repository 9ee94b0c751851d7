"""Issue 17: a repeat savedmodel save writes ``variables/`` in one traced op. The files must
hold what ``tf.train.Checkpoint`` would write for the same root (every key, every value)
and stay a SavedModel that TensorFlow and trainer load with the saved values."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.bundle import variables_writer
from trainer.save_backends.savedmodel.save import trace_cache


@pytest.fixture(autouse=True, params=["SaveV2", "tensor_bundle"])
def _writer(request, monkeypatch):
    """Every test with both writers of a repeat save: TensorFlow's ``SaveV2`` (these small
    models) and trainer's own bundle writer (from ``OWN_WRITER_FROM`` bytes, made 0 here)."""
    if request.param == "tensor_bundle":
        monkeypatch.setattr(variables_writer, "OWN_WRITER_FROM", 0)
    return request.param


def _trained_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(16, 5)), rng.normal(size=(16, 1)), batch_size=8, verbose=0)
    return model


def _values(prefix: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


def test_repeat_save_writes_what_tf_checkpoint_writes(tmp_path):
    model = _trained_model()
    backend = get_backend("savedmodel")
    first = backend.save(model, tmp_path / "first")
    entry = trace_cache.cached(model)
    assert entry is not None and entry.writer is not None
    model.train_on_batch(np.ones((8, 5)), np.zeros((8, 1)))  # new values, same structure
    repeat = backend.save(model, tmp_path / "repeat")
    ours = _values(str(repeat / "variables" / "variables"))
    reference = tmp_path / "reference" / "variables"
    tf.train.Checkpoint(entry.traced.root).write(str(reference))
    expected = _values(str(reference))
    graph = "_CHECKPOINTABLE_OBJECT_GRAPH"  # TF2 checkpoints keep their object graph here
    assert set(ours) == set(expected)
    for key in sorted(set(ours) - {graph}):
        np.testing.assert_array_equal(ours[key], expected[key], err_msg=key)
    # The object graph is the one tf.saved_model.save wrote for this SavedModel.
    assert ours[graph] == _values(str(first / "variables" / "variables"))[graph]

    loaded = tf.saved_model.load(str(repeat))
    for stored, live in zip(loaded.model_variables, entry.traced.root.model_variables, strict=True):
        np.testing.assert_array_equal(stored.numpy(), live.numpy())
    revived = backend.load(repeat).model
    x = np.random.default_rng(1).normal(size=(4, 5)).astype("float32")
    np.testing.assert_array_equal(revived.predict(x, verbose=0), model.predict(x, verbose=0))
    for a, b in zip(model.optimizer.variables, revived.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def test_checkpoints_the_walk_cannot_match_exactly_get_no_writer(tmp_path):
    """No writer (the save keeps tf.train.Checkpoint) when the first save's checkpoint
    holds a value that is not a plain variable, or a key the root does not reach."""
    root = tf.Module()
    root.model_variables = [tf.Variable([1.0, 2.0])]
    plain = str(tmp_path / "plain" / "variables")
    tf.train.Checkpoint(root).write(plain)
    writer = variables_writer.from_first_save(root, plain)
    assert writer is not None and writer.keys == ["model_variables/0/.ATTRIBUTES/VARIABLE_VALUE"]

    with_table = tf.Module()
    with_table.model_variables = [tf.Variable([1.0])]
    with_table.table = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, -1)
    table = str(tmp_path / "table" / "variables")
    tf.train.Checkpoint(with_table).write(table)
    assert variables_writer.from_first_save(with_table, table) is None

    bigger = tf.Module()
    bigger.model_variables = [tf.Variable([1.0, 2.0]), tf.Variable(3.0)]
    extra = str(tmp_path / "extra" / "variables")
    tf.train.Checkpoint(bigger).write(extra)
    assert variables_writer.from_first_save(root, extra) is None


def test_traced_write_holds_each_moments_values_like_the_eager_one(tmp_path):
    """``prepare_repeat_saves`` (async checkpointing's rehearsal) traces the repeat-save
    write: each later save is one call that reads the variables when called, and writes
    the keys and values the eager write does."""
    model = _trained_model()
    backend = get_backend("savedmodel")
    backend.save(model, tmp_path / "first")
    writer = trace_cache.cached(model).writer
    eager = tmp_path / "eager" / "variables"
    writer.write(str(eager))
    assert backend.prepare_repeat_saves(model, tmp_path / "scratch") and writer.traced
    traced = tmp_path / "traced" / "variables"
    writer.write(str(traced))
    expected = _values(str(eager))
    assert set(_values(str(traced))) == set(expected)
    for key, value in _values(str(traced)).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)
    x, y = np.ones((8, 5)), np.zeros((8, 1))
    for step in range(2):  # new values each time: read at the call, not at the trace
        model.train_on_batch(x, y)
        path = backend.save(model, tmp_path / f"repeat{step}")
        revived = backend.load(path).model
        for a, b in zip(model.variables, revived.variables, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
        for a, b in zip(model.optimizer.variables, revived.optimizer.variables, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def test_async_rehearsal_traces_the_shadows_repeat_writes(tmp_path):
    from trainer.checkpointing import AsyncBackend

    model = _trained_model()
    saver = AsyncBackend(get_backend("savedmodel"))
    saver.prepare(model)
    saver.wait()
    shadow_entry = trace_cache.cached(saver.snapshot(model))
    assert shadow_entry is not None and shadow_entry.writer.traced
    model.train_on_batch(np.ones((8, 5)), np.zeros((8, 1)))
    path = saver.save(model, tmp_path / "ckpt")
    saver.wait()
    revived = get_backend("savedmodel").load(path).model
    for a, b in zip(model.optimizer.variables, revived.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
