"""The variables of a trainer SavedModel, read straight from its ``variables/`` checkpoint.

A load whose every layer is rebuilt from its class calls none of the traced functions, yet
``tf.saved_model.load`` imports all of them (for a deep model most of the load time). Such
a load reads the values here instead: the checkpoint's own object graph says under which
key each entry of the root's ``model_variables`` and ``optimizer_variables`` lists is
stored, so nothing is guessed from names, and the shapes and dtypes are checked against
the rebuilt variables before any value is assigned. ``saved_model.pb`` is still parsed
(milliseconds; the graph is not imported), so a directory that is no SavedModel any more
is refused as damaged rather than loaded from its other files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.protobuf import saved_model_pb2, trackable_object_graph_pb2

from trainer._compat import tensorflow as tf_compat
from trainer.errors import CorruptCheckpointError, TrainerError
from trainer.save_backends.savedmodel.bundle import index_reader
from trainer.storage import arrival as arrivals
from trainer.storage import integrity

OBJECT_GRAPH = tf_compat.OBJECT_GRAPH_KEY


def root_list(nodes: Any, name: str) -> list[int]:
    """The node ids of the entries of the root's tracked list ``name``, in list order, in an
    object graph (a SavedModel's or a checkpoint's: both name children the same way). An
    empty list is not tracked at all: ``[]``. Raises ``KeyError`` for a missing entry."""
    children = {c.local_name: c.node_id for c in nodes[0].children}
    if name not in children:
        return []
    entries = {c.local_name: c.node_id for c in nodes[children[name]].children}
    return [entries[str(position)] for position in range(len(entries))]


def check_saved_model(directory: Path, layers: int) -> Any:
    """The parsed ``saved_model.pb``; refuse one that does not parse or whose object graph
    does not hold the ``layers`` layer nodes the metadata lists (the error
    ``tf.saved_model.load`` of the same directory would lead to)."""
    source = Path(directory) / "saved_model.pb"
    proto = saved_model_pb2.SavedModel()
    problem = None
    try:
        proto.ParseFromString(source.read_bytes())
        found = len(root_list(proto.meta_graphs[0].object_graph_def.nodes, "layer_nodes"))
        if found != layers:
            problem = f"{found} layer nodes, the metadata lists {layers}"
    except (OSError, DecodeError, IndexError, KeyError) as err:
        problem = f"{type(err).__name__}: {str(err)[:200]}"
    if problem is not None:
        raise CorruptCheckpointError(
            f"{directory} cannot be loaded as a SavedModel ({problem}). The directory is "
            f"damaged; load an older checkpoint. Received: {str(source)!r}"
        )
    return proto


class Stored:
    """Shape and dtype of one stored variable (what revival checks before binding)."""

    __slots__ = ("dtype", "key", "shape")

    def __init__(self, key: str, shape: list[int], dtype: tf.DType):
        self.key = key
        self.shape = tf.TensorShape(shape)
        self.dtype = dtype


class StoredVariables:
    """The ``model_variables`` and ``optimizer_variables`` of a checkpoint, by position."""

    def __init__(self, directory: Path):
        prefix = str(Path(directory) / "variables" / "variables")
        try:
            graph = _graph_ahead(Path(directory))
            if graph is None:
                self._reader, graph = tf_compat.read_checkpoint(prefix)
            else:
                self._reader = tf.train.load_checkpoint(prefix)  # the index only, for now
        except Exception as err:  # missing or damaged index/data files, foreign checkpoint
            raise CorruptCheckpointError(
                f"{directory}: the variables checkpoint cannot be read ({type(err).__name__}: "
                f"{str(err)[:300]}). The directory is damaged; load an older checkpoint. "
                f"Received: {prefix!r}"
            ) from err
        shapes = self._reader.get_variable_to_shape_map()
        dtypes = self._reader.get_variable_to_dtype_map()
        self.where = str(directory)
        self.model = self._list(graph, "model_variables", shapes, dtypes)
        self.optimizer = self._list(graph, "optimizer_variables", shapes, dtypes)

    def _list(self, graph: Any, name: str, shapes: dict, dtypes: dict) -> list[Stored]:
        """The entries of the root's list attribute ``name``, in list order."""
        nodes = graph.nodes
        try:
            node_ids = root_list(nodes, name)
        except KeyError as missing:
            raise self._damaged(f"entry {missing} of {name!r} is missing", None) from None
        found = []
        for position, node_id in enumerate(node_ids):
            attributes = nodes[node_id].attributes
            key = next(
                (a.checkpoint_key for a in attributes if a.name == tf_compat.VARIABLE_VALUE), None
            )
            if key is None or key not in shapes:
                raise self._damaged(f"entry {position} of {name!r} has no value", key)
            found.append(Stored(key, shapes[key], dtypes[key]))
        return found

    def _damaged(self, what: str, received: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: {what} in the variables checkpoint. The directory is damaged; "
            f"load an older checkpoint. Received: {received!r}"
        )

    def value(self, stored: Stored) -> np.ndarray:
        integrity.await_digests()  # the data file's digest, checked while layers were built
        return self._reader.get_tensor(stored.key)

    def optimizer_arrays(self) -> list[np.ndarray]:
        return [self.value(s) for s in self.optimizer]


DATA = "variables/variables.data-00000-of-00001"


def _graph_ahead(directory: Path) -> Any:
    """The checkpoint's object graph while its data file still arrives from a store
    (``trainer.storage.arrival``): read from the index where it lies, and those bytes
    alone fetched, so that the layers are rebuilt during the download. None when the
    data file is here (TensorFlow's reader reads it), or the entry cannot be found that
    way: then after waiting for the whole file."""
    arrival = arrivals.current()
    if arrival is None or not arrival.is_pending(directory, DATA):
        return None
    entry = index_reader.find_entry(directory / "variables" / "variables.index", OBJECT_GRAPH)
    raw = None
    if entry is not None and entry.shard_id == 0 and entry.dtype == tf.string.as_datatype_enum:
        try:
            raw = arrival.read_range(DATA, entry.offset, entry.size)
        except (OSError, TrainerError):  # the whole download will say what is wrong
            raw = None
    value = index_reader.scalar_string(raw) if raw is not None else None
    if value is None:
        integrity.await_digests()  # the whole data file, then TensorFlow's reader
        return None
    return trackable_object_graph_pb2.TrackableObjectGraph.FromString(value)


class DeferredValues:
    """The stored values of a revived model, assigned as late as the load allows.

    Only the values need the variables data file; the rebuild, the compile and the
    optimizer's build need shapes alone. So a load from a store, whose data file may still
    be downloading (``trainer.storage.arrival``), does all of those first and waits for the
    file only here: ``assign_model`` (once) before anything that may read a variable (a
    layer's own state restore), ``optimizer_arrays`` at the very end. ``read`` None: the
    values came with the storage (``tf.saved_model.load``), nothing to assign."""

    def __init__(self, reviver: Any, read: Any, optimizer: Any):
        self._reviver = reviver
        self._read = read
        self._optimizer = optimizer

    def assign_model(self) -> None:
        if self._read is not None:
            read, self._read = self._read, None
            self._reviver.assign_stored(read)

    def optimizer_arrays(self) -> list[np.ndarray]:
        self.assign_model()
        return self._optimizer()
