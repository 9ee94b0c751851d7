"""``index_reader.find_entry`` reads the index of TensorFlow's own bundles and ours."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from trainer._compat import tensorflow as tf_compat
from trainer.save_backends.savedmodel.bundle import index_reader, tensor_bundle

DATA = tensor_bundle.DATA_SUFFIX


@pytest.mark.parametrize("count", [3, 600])  # one index block; several data blocks
def test_every_entry_of_a_tensorflow_checkpoint_is_found(tmp_path, count):
    """Offsets and sizes point at the bytes TensorFlow reads: the object graph's element
    parses to the graph TensorFlow's reader returns; every variable's shape matches."""
    module = tf.Module()
    module.values = [tf.Variable(np.full((i % 7 + 1, 3), i, "float32")) for i in range(count)]
    prefix = tf.train.Checkpoint(module).write(str(tmp_path / "variables"))
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    for key, shape in shapes.items():
        entry = index_reader.find_entry(tmp_path / "variables.index", key)
        assert entry is not None, key
        assert list(tf.TensorShape(entry.shape)) == shape
    entry = index_reader.find_entry(tmp_path / "variables.index", tf_compat.OBJECT_GRAPH_KEY)
    raw = (tmp_path / f"variables{DATA}").read_bytes()[entry.offset : entry.offset + entry.size]
    assert index_reader.scalar_string(raw) == reader.get_tensor(tf_compat.OBJECT_GRAPH_KEY)
    assert index_reader.find_entry(tmp_path / "variables.index", "absent/key") is None


def test_a_damaged_index_gives_none(tmp_path):
    module = tf.Module()
    module.value = tf.Variable([1.0, 2.0])
    tf.train.Checkpoint(module).write(str(tmp_path / "variables"))
    index = tmp_path / "variables.index"
    index.write_bytes(index.read_bytes()[:-3])
    assert index_reader.find_entry(index, tf_compat.OBJECT_GRAPH_KEY) is None
