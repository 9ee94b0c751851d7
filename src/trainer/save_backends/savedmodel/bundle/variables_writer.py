"""Write the ``variables/`` checkpoint of a repeat save with one ``SaveV2`` op.

``tf.train.Checkpoint(root).write`` walks the object graph, serializes it, and reads
every variable through a Python closure on every call: for a small model that Python is
most of a repeat save (about 0.1 s for 63 variables here), for a large one a quarter.
Between saves of a structurally unchanged model none of it changes but the values. So
after the first (full) save, the keys and the serialized object graph are taken from the
checkpoint ``tf.saved_model.save`` itself wrote, each key is matched to its variable by
walking that object graph from the traced root (names, not guesses), and later saves run
one ``SaveV2`` over the same keys: the same tensor-bundle files, byte for byte the
same layout, that ``tf.saved_model.load`` and ``tf.train.load_checkpoint`` read.

Anything the walk cannot match exactly (a saveable that is not a plain variable value,
optimizer slot references, a key without a variable) gives no writer, and the save keeps
using ``tf.train.Checkpoint.write``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from trainer._compat import tensorflow as tf_compat
from trainer.save_backends.savedmodel.bundle import tensor_bundle
from trainer.storage import direct_io, integrity

log = logging.getLogger(__name__)


@dataclass
class Written:
    """What one write knows of its files without reading them back: the FarmHash
    ``Fingerprint64`` of the ``.index`` (8 bytes, what the SavedModel fingerprint's
    checkpoint hash is made of: ``tf_compat.fingerprint_for_new_variables``), and the size
    and digest of each file (``variables/<name>``) for the manifest."""

    index_hash: bytes | None = None
    known: dict[str, tuple[int, str]] = field(default_factory=dict)


class VariablesWriter:
    """``write(prefix)`` writes the checkpoint of ``root`` that the first save wrote.

    The write runs eagerly: one raw ``ReadVariableOp`` per variable, then one ``SaveV2``.
    A ``tf.function`` around the same ops costs less per write but must be traced first,
    which costs 0.4-2 s on an 800-variable model: done on the first repeat save, it made a
    second save take ten times the steady one (issue 17's ``savedmodel.second_save``). So
    the traced write is made only ahead of time, by ``trace`` (async checkpointing calls it
    in its writer thread when training starts): from then on each write is one call, whose
    Python (the writer thread's share of the GIL, which the training loop waits for) is a
    tenth of the eager loop's on the default model and a twentieth on 800 variables.
    """

    def __init__(self, keys: list[str], variables: list[tf.Variable], graph: bytes):
        self.keys = keys
        self.variables = variables
        self.object_graph = graph  # serialized TrackableObjectGraph
        self._names = tf.constant([tf_compat.OBJECT_GRAPH_KEY, *keys])
        self._slices = tf.constant([""] * (len(keys) + 1))
        self._graph = tf.constant(graph)
        self._traced: Any = None  # the concrete function ``trace`` made
        self._bundle_writable = total_bytes(variables) >= OWN_WRITER_FROM and bundle_writable(
            variables
        )

    def trace(self, scratch_prefix: str) -> None:
        """Make every later ``write`` one call of a traced function, and call it once (into
        ``scratch_prefix``, a throwaway location): the first call instantiates it in
        TensorFlow's runtime. The function reads the variables when called, so each write
        holds the values of that moment, as the eager one does."""
        traced = tf.function(self._write_ops, autograph=False)
        concrete = traced.get_concrete_function(tf.TensorSpec([], tf.string))
        concrete(tf.constant(scratch_prefix))
        self._traced = concrete

    @property
    def traced(self) -> bool:
        return self._traced is not None

    def write(self, prefix: str) -> Written:
        """Write the checkpoint at ``prefix``. Traced (async checkpointing), in one call
        that also hashes the index. Otherwise with trainer's own bundle writer where every
        value's dtype is one it writes (``tensor_bundle``: around the page cache, hashed
        on the way), else with one eager ``SaveV2``."""
        if self._traced is not None:
            return Written(self._traced(tf.constant(prefix)).numpy().tobytes())
        if self._bundle_writable and direct_io.direct_wanted():
            return write_bundle(prefix, self.keys, self.variables, self.object_graph)
        self._write_ops(tf.constant(prefix))
        return Written()

    def _write_ops(self, prefix: Any) -> Any:
        """The ops of one write, run eagerly by ``write`` or traced by ``trace``."""
        # The reads run where each variable lives; the bundle is written from the host.
        values = [
            tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype) for v in self.variables
        ]
        with tf.device("/cpu:0"):
            save = tf.raw_ops.SaveV2(
                prefix=prefix,
                tensor_names=self._names,
                shape_and_slices=self._slices,
                tensors=[self._graph, *values],
            )
        if tf.executing_eagerly():
            return None  # ran already; no op to keep
        # Traced, an op nothing depends on is pruned (SaveV2 is not among the ops a
        # function keeps by itself): the output depends on it, as in TensorFlow's saver.
        with tf.control_dependencies([save]):
            index = tf.io.read_file(tf.strings.join([prefix, ".index"]))
        return tf.fingerprint(tf.reshape(index, [1]), method="farmhash64")[0]


# From this many bytes of variables a repeat save writes them with ``tensor_bundle``, below
# it with ``SaveV2``. The bypass of the page cache is worth 0.15-0.25 s on the large benchmark
# model (97 MiB), nothing on 1 MiB, while the bundle writer's Python per variable costs the
# deep model (800 variables, 1.2 MiB) 0.064 s against SaveV2's 0.047 s per repeat save and the
# small one 0.011 against 0.010 s (``benchmarks.repeat_pages``, alternating, idle machine).
OWN_WRITER_FROM = 8 << 20


def total_bytes(variables: list[tf.Variable]) -> int:
    """The bytes of the variables' values: what a checkpoint of them writes, or a copy holds."""
    return sum(v.shape.num_elements() * v.dtype.size for v in variables)


def bundle_writable(variables: list[tf.Variable]) -> bool:
    """Whether ``write_bundle`` writes these: every dtype one ``tensor_bundle`` writes, on
    a little-endian host (the bundle stores host-order bytes under a little-endian header,
    what TensorFlow writes on every platform it builds for)."""
    return sys.byteorder == "little" and all(v.dtype in tensor_bundle.SUPPORTED for v in variables)


def write_bundle(
    prefix: str, keys: list[str], variables: list[tf.Variable], graph: bytes
) -> Written:
    """The checkpoint of ``variables`` under ``keys`` with the serialized object graph
    ``graph``, written by ``tensor_bundle`` (around the page cache, hashed on the way)."""

    def reader(variable: tf.Variable) -> Any:
        # The read shares the variable's buffer (copied on a later assign), and
        # ``np.asarray`` shares the read's: the bundle writer copies it once, into its
        # staging buffer. ``variable.numpy()`` would copy it first.
        return lambda: np.asarray(
            tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype)
        )

    entries = [(tf_compat.OBJECT_GRAPH_KEY, tf.string, lambda: graph)]
    entries += [(k, v.dtype, reader(v)) for k, v in zip(keys, variables, strict=True)]
    with tf.device("/cpu:0"):
        written = tensor_bundle.write_bundle(prefix, entries)
    index_hash = tf.fingerprint(tf.constant([written.index]), method="farmhash64")
    name = os.path.basename(prefix)
    data = f"variables/{name}{tensor_bundle.DATA_SUFFIX}"
    index = f"variables/{name}{tensor_bundle.INDEX_SUFFIX}"
    return Written(
        index_hash.numpy()[0].tobytes(),
        {
            data: (written.data_size, written.data_sha256),
            index: integrity.known_digest(written.index),
        },
    )


def from_first_save(root: Any, prefix: str) -> VariablesWriter | None:
    """A writer for ``root`` matching the checkpoint at ``prefix``, or None if any part of
    that checkpoint is not a plain variable value reached through the object graph."""
    try:
        reader, graph = tf_compat.read_checkpoint(prefix)
        graph_bytes = reader.get_tensor(tf_compat.OBJECT_GRAPH_KEY)  # written back as read
        stored = set(reader.get_variable_to_shape_map()) - {tf_compat.OBJECT_GRAPH_KEY}
    except (tf.errors.OpError, ValueError) as err:
        log.info("No one-op variables writer (%s); using tf.train.Checkpoint", err)
        return None
    found = match_keys(root, graph)
    if found is None or set(found) != stored:
        log.info("No one-op variables writer: the object graph does not match exactly")
        return None
    keys = sorted(found)
    return VariablesWriter(keys, [found[k] for k in keys], graph_bytes)


def match_keys(root: Any, graph: Any) -> dict[str, tf.Variable] | None:
    """Checkpoint key -> variable, walking ``graph`` and the objects from ``root`` in step."""
    view = tf.train.TrackableView(root)
    objects: dict[int, Any] = {0: root}
    pending = [0]
    found: dict[str, tf.Variable] = {}
    while pending:
        node_id = pending.pop()
        node, obj = graph.nodes[node_id], objects[node_id]
        if node.slot_variables:
            return None
        for attribute in node.attributes:
            if attribute.name != tf_compat.VARIABLE_VALUE or not _plain_variable(obj):
                return None
            found[attribute.checkpoint_key] = obj
        children = view.children(obj) if node.children else {}
        for child in node.children:
            target = children.get(child.local_name)
            if target is None:
                if child.node_id in objects:
                    continue  # a back reference (``tf.train.Checkpoint(root)`` adds "root")
                if _holds_values(graph, child.node_id, set()):
                    return None
                continue  # added by the SavedModel save (``signatures``): no values
            if child.node_id in objects:
                if objects[child.node_id] is not target:
                    return None
                continue
            objects[child.node_id] = target
            pending.append(child.node_id)
    return found


def _plain_variable(obj: Any) -> bool:
    """A single-device variable: a distributed one is saved by TF's own saveables."""
    return isinstance(obj, tf.Variable) and not isinstance(obj, tf.distribute.DistributedValues)


def _holds_values(graph: Any, node_id: int, seen: set[int]) -> bool:
    if node_id in seen:
        return False
    seen.add(node_id)
    node = graph.nodes[node_id]
    if node.attributes or node.slot_variables:
        return True
    return any(_holds_values(graph, c.node_id, seen) for c in node.children)
