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

from tests import savedmodel_zoo as zoo
from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel import variables_first


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


def test_distributed_or_non_variable_lists_are_left_to_tensorflows_save(tmp_path):
    class Plan:
        def __init__(self, storages):
            self.storages = storages

        def root_lists(self):
            return {"model_variables": self.storages, "optimizer_variables": []}

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        mirrored = tf.Variable(1.0)
    assert variables_first.start(Plan([mirrored]), tmp_path) is None
    assert not (tmp_path / "variables").exists()
    write = variables_first.start(Plan([tf.Variable(2.0)]), tmp_path)
    write.join()
    assert (tmp_path / "variables" / "variables.index").exists()
