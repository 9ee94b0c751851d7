"""Issue 17 (first save): the SaverDef of a savedmodel checkpoint is written by trainer
(``savedmodel/saver_def.py``), not traced by TensorFlow over every variable.

What must hold, checked with TensorFlow's own TF1 loader (what TF Serving and
``saved_model_cli run`` do: run the SaverDef's restore op, then the signature): the
variables it restores are the saved ones, so serving gives the model's outputs; its save op
writes the checkpoint TensorFlow's own would (same keys and values, object graph
included); a repeat save keeps it and the loader restores the new values; a checkpoint
holding more than plain variables (a hash table's entries) gets TensorFlow's own SaverDef.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel.bundle import saver_def


def _saver(path):
    model = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes())
    return model.meta_graphs[0].saver_def


def _served_by_tf1(path, x):
    """Load ``path`` with TF1's loader (it runs the SaverDef's restore op) and serve ``x``."""
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        signature = meta.signature_def["serving_default"]
        (name,) = [spec.name for spec in signature.inputs.values()]
        (output,) = [spec.name for spec in signature.outputs.values()]
        return session.run(output, {name: x})


def test_tf1_loader_restores_through_our_saverdef_and_its_save_op_writes_the_same(tmp_path):
    keras.utils.set_random_seed(4)
    model, x, y, _ = zoo.nested_three_deep()
    model.fit(x, y, epochs=1, verbose=0)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    saver = _saver(path)
    assert saver.restore_op_name.startswith(saver_def.SCOPE)
    assert saver.filename_tensor_name == f"{saver_def.FILENAME}:0"
    np.testing.assert_allclose(_served_by_tf1(path, x), model.predict(x, verbose=0), atol=1e-6)

    resaved = str(tmp_path / "resaved" / "variables")
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        session.run(meta.saver_def.save_tensor_name, {meta.saver_def.filename_tensor_name: resaved})
    ours = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    again = tf.train.load_checkpoint(resaved)
    keys = sorted(ours.get_variable_to_shape_map())
    assert keys == sorted(again.get_variable_to_shape_map())
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in keys and len(keys) > 10
    for key in keys:
        assert np.array_equal(ours.get_tensor(key), again.get_tensor(key)), key


def test_a_repeat_save_keeps_the_saverdef_and_restores_its_own_values(tmp_path):
    _, model, x, _y, first, second = zoo.saved_before_and_after_training(tmp_path, 5, 2)
    assert (first / "saved_model.pb").read_bytes() == (second / "saved_model.pb").read_bytes()
    expected = model.predict(x, verbose=0)
    np.testing.assert_allclose(_served_by_tf1(second, x), expected, atol=1e-6)
    assert not np.allclose(_served_by_tf1(first, x), expected)  # fitting changed it


class TableLookup(keras.layers.Layer):
    """A layer holding a mutable hash table: its entries are checkpoint entries of their
    own (``table-keys``/``table-values``), not variables."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)
        self.table.insert(tf.constant([1, 2], tf.int64), tf.constant([10.0, 20.0]))

    def call(self, ids):
        return tf.ensure_shape(self.table.lookup(tf.cast(ids, tf.int64)), ids.shape)

    def compute_output_shape(self, shape):
        return shape


def test_a_checkpoint_with_more_than_variables_gets_tensorflows_own_saverdef(tmp_path):
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(TableLookup()(ids)))
    model.compile("adam", "mse")
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert not _saver(path).restore_op_name.startswith(saver_def.SCOPE)
    x = np.array([[1, 2], [2, 3]], dtype="int64")
    np.testing.assert_allclose(_served_by_tf1(path, x), model.predict(x, verbose=0), atol=1e-6)


def test_if_our_saverdef_cannot_be_built_the_save_keeps_tensorflows(tmp_path, monkeypatch):
    """Should a TensorFlow release move what ``saver_def`` relies on (here: no OpDef for
    its ops), the save is not lost: it is written again with TensorFlow's own SaverDef."""
    from trainer._compat import tensorflow as tf_compat

    def moved(names):
        raise KeyError(f"no OpDef for {names[0]!r}")

    monkeypatch.setattr(tf_compat, "op_defs", moved)
    keras.utils.set_random_seed(6)
    model, x, _, _ = zoo.nested_three_deep()
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert not _saver(path).restore_op_name.startswith(saver_def.SCOPE)
    np.testing.assert_allclose(_served_by_tf1(path, x), model.predict(x, verbose=0), atol=1e-6)
    loaded = get_backend("savedmodel").load(path).model
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
