"""Issue 17 (first save): a first savedmodel save writes the variables in a thread while the
functions are traced (``savedmodel/variables_first.py``), and TensorFlow's save writes no
checkpoint of its own.

What must hold: the checkpoint restores through TensorFlow's own full loader (by the paths
from the root it matches objects with) to the model's values, with TensorFlow's keys; a
save whose tracing fails leaves no writer running and publishes nothing.
"""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import savedmodel_zoo as zoo
from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.save import variable_plan, variables_first


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    """Written first whatever the size: the test models are small."""
    monkeypatch.setattr(variables_first, "WORTH_FROM", 0)


def test_first_save_checkpoint_restores_through_tensorflows_loader(tmp_path):
    keras.utils.set_random_seed(5)
    model, x, y, _ = zoo.nested_three_deep()
    model.fit(x, y, epochs=1, verbose=0)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    keys = set(reader.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
    n_model, n_optimizer = len(model.variables), len(model.optimizer.variables)
    assert keys == {
        *(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(n_model)),
        *(f"optimizer_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(n_optimizer)),
    }
    loaded = tf.saved_model.load(str(path))  # TensorFlow's full import and restore
    by_path = {v.path: v.numpy() for v in model.variables}
    assert len(loaded.model_variables) == n_model
    restored = sorted(np.asarray(v.numpy()).tobytes() for v in loaded.model_variables)
    assert restored == sorted(np.asarray(a).tobytes() for a in by_path.values())
    optimizer = [np.asarray(v.numpy()).tobytes() for v in loaded.optimizer_variables]
    assert optimizer == [np.asarray(v.numpy()).tobytes() for v in model.optimizer.variables]
    served = loaded.signatures["serving_default"](tf.constant(x))
    (output,) = served.values()
    np.testing.assert_allclose(output.numpy(), model.predict(x, verbose=0), atol=1e-6)


class _EagerOnly(keras.Model):
    """Runs eagerly; its call cannot be traced (``.numpy()`` on a symbolic tensor)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, inputs):
        scale = float(inputs.numpy().mean()) if tf.executing_eagerly() else inputs.numpy()
        return self.dense(inputs) * scale


def test_a_save_whose_tracing_fails_leaves_no_writer_and_no_checkpoint(tmp_path):
    model = _EagerOnly()
    model(np.ones((2, 4), "float32"))
    with pytest.raises(ModelNotReadyError):
        get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert not [t for t in threading.enumerate() if t.name == "trainer-variables"]
    assert not (tmp_path / "ckpt").exists()
    assert not any(tmp_path.iterdir())  # no temporary sibling left behind either


class _Counting(keras.layers.Layer):
    """Weights, a metric it updates and a plain ``tf.Variable`` it keeps: variables the
    root reaches only through the layer's node (``state_variables``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.seen = keras.metrics.Mean(name="seen")
        self.raw = tf.Variable(2.0, trainable=False)

    def call(self, inputs):
        self.seen.update_state(inputs)
        return self.dense(inputs) * self.raw


def _state_model():
    inputs = keras.Input((4,), batch_size=2)  # a stateful RNN's batch is fixed
    x = _Counting(name="counting")(inputs)
    x = keras.layers.Reshape((3, 1))(x)
    outputs = keras.layers.LSTM(2, stateful=True, name="lstm")(x)
    return keras.Model(inputs, outputs)


def test_variables_beyond_the_weights_are_in_the_first_save_checkpoint(tmp_path):
    """A metric a layer updates, a stateful RNN's states and a raw ``tf.Variable``: TensorFlow's
    loader refuses a checkpoint that leaves any of them out (an earlier version of this
    change did), and serving through the TF1 loader reads them by their keys."""
    keras.utils.set_random_seed(6)
    model = _state_model()
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    model.predict(x, verbose=0)  # moves the metric and the states off their start
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    loaded = tf.saved_model.load(str(path))
    lstm = model.get_layer("lstm")
    counting = model.get_layer("counting")
    state = {f"v{i}": v.numpy() for i, v in enumerate((*counting.seen.variables, counting.raw))}
    state.update({f"state{i}": s.numpy() for i, s in enumerate(lstm.states)})
    found = [v.numpy() for node in loaded.layer_nodes for v in getattr(node, "state_variables", [])]
    assert len(found) == len(state) == 5
    assert sorted(np.asarray(a).tobytes() for a in found) == sorted(
        np.asarray(a).tobytes() for a in state.values()
    )
    with tf.compat.v1.Session(graph=tf.Graph()) as session:  # what TF Serving runs
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        signature = meta.signature_def["serving_default"]
        (name,) = [spec.name for spec in signature.inputs.values()]
        (output,) = [spec.name for spec in signature.outputs.values()]
        served = session.run(output, {name: x})
    expected = model.predict(x, verbose=0)  # the first call from the states as saved
    np.testing.assert_allclose(served, expected, atol=1e-6)


def test_distributed_variables_and_resources_are_left_to_tensorflows_save(tmp_path):
    def plan(storages, resources=()):  # one layer holding ``storages``
        return variable_plan.VariablePlan(
            layers=[None],
            layer_index={},
            optimizer=[],
            storages=storages,
            records=[],
            index={},
            state=[[]],
            resources=[list(resources)],
        )

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        mirrored = tf.Variable(1.0)
    assert variables_first.start(plan([mirrored]), tmp_path) is None
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer([1], [2]), -1)
    assert variables_first.start(plan([tf.Variable(1.0)], [table]), tmp_path) is None
    assert not (tmp_path / "variables").exists()
    write = variables_first.start(plan([tf.Variable(2.0)]), tmp_path)
    write.join()
    assert (tmp_path / "variables" / "variables.index").exists()


def test_the_bundle_written_first_is_what_tf_checkpoint_writes(tmp_path):
    """Where trainer writes the first save's checkpoint itself (``tensor_bundle``, with
    TensorFlow's object graph and keys), it holds what ``tf.train.Checkpoint(holder).write``
    writes: the same keys, dtypes, shapes and bytes per tensor (TensorFlow's reader checks
    each one's CRC32C as it reads), the same object graph and data size (the tensors' order
    in the data file differs: ``SaveV2`` keeps the order it is given, trainer key order),
    and the sizes and digests it hands the manifest are the files'."""
    import hashlib

    keras.utils.set_random_seed(7)
    model = _state_model()
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    model.fit(x, np.zeros((2, 2)), batch_size=2, verbose=0)
    plan = variable_plan.plan_variables(model)
    write = variables_first.start(plan, tmp_path / "ours")
    assert write is not None and write.own_writer
    write.join()
    reference = tmp_path / "theirs" / "variables" / "variables"
    tf.train.Checkpoint(plan.checkpointed()).write(str(reference))
    ours = tmp_path / "ours" / "variables"
    mine, theirs = (
        tf.train.load_checkpoint(str(ours / "variables")),
        tf.train.load_checkpoint(str(reference)),
    )
    assert mine.get_variable_to_dtype_map() == theirs.get_variable_to_dtype_map()
    assert mine.get_variable_to_shape_map() == theirs.get_variable_to_shape_map()
    for key in theirs.get_variable_to_shape_map():
        a, b = mine.get_tensor(key), theirs.get_tensor(key)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), key
    data = "variables.data-00000-of-00001"
    assert (ours / data).stat().st_size == (reference.parent / data).stat().st_size
    for name in ("variables.index", data):
        content = (ours / name).read_bytes()
        size, digest = write.known[f"variables/{name}"]
        assert (size, digest) == (len(content), hashlib.sha256(content).hexdigest())


def test_a_save_written_first_by_trainer_verifies_loads_and_saves_again(tmp_path):
    """The whole save with the early bundle: its manifest (sizes and digests the writer
    handed over, not read back) verifies, the load gives the model's outputs, optimizer
    and states, and a repeat save of the trained model is exact too."""
    keras.utils.set_random_seed(8)
    model = _state_model()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 4)).astype("float32")
    model.fit(x, np.zeros((2, 2)), batch_size=2, verbose=0)
    backend = get_backend("savedmodel")
    for name in ("first", "repeat"):
        path = backend.save(model, tmp_path / name)
        backend.check_integrity(path, digests=True, strict=True)
        loaded = backend.load(path).model
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(model.variables, loaded.variables, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
        model.fit(x, np.ones((2, 2)), batch_size=2, verbose=0)  # new values for the repeat
