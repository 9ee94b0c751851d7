"""Read a legacy tf.keras SavedModel directory without tf_keras: its ``keras_metadata.pb``
(per-object JSON metadata) and its variables checkpoint, walked by object path.

The checkpoint's object graph has the same node ids as the SavedModel's object graph that
``keras_metadata.pb`` refers to, so a layer's node id leads to its children by attribute
name (``kernel``, ``cell``, ``inner``) and to its ordered ``variables`` list, whose
elements are read from the checkpoint by their recorded keys: nothing is matched by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer._compat import tensorflow as tf_compat
from trainer.errors import CorruptCheckpointError, NotACheckpointError
from trainer.save_backends.legacy.metadata_proto import SavedMetadata
from trainer.storage import limits

METADATA_FILE = "keras_metadata.pb"
SAVED_MODEL_FILE = "saved_model.pb"
TRAINER_METADATA = "assets.extra/trainer_metadata.json"


def is_legacy(path: Path) -> bool:
    """A directory holding ``saved_model.pb`` and ``keras_metadata.pb`` and no trainer
    metadata: what tf.keras' ``model.save(dir)`` wrote."""
    path = Path(path)
    return (
        path.is_dir()
        and (path / SAVED_MODEL_FILE).is_file()
        and (path / METADATA_FILE).is_file()
        and not (path / TRAINER_METADATA).exists()
    )


@dataclass
class Node:
    """One object of the legacy object graph that ``keras_metadata.pb`` describes."""

    node_id: int
    path: str
    identifier: str
    metadata: dict[str, Any]


@dataclass
class LegacyDir:
    """The parsed directory: Keras nodes by id and path, the checkpoint's object graph."""

    path: Path
    nodes: dict[int, Node]
    graph: Any  # TrackableObjectGraph
    reader: Any  # tf.train.CheckpointReader
    by_path: dict[str, Node] = field(default_factory=dict)
    # legacy variable node id -> the Keras 3 variable it was placed into
    placed: dict[int, Any] = field(default_factory=dict)
    _saved_variables: dict[int, Any] | None = None

    @property
    def root(self) -> Node:
        return self.by_path["root"]

    def children(self, node_id: int) -> dict[str, int]:
        """Attribute name -> node id of the object graph node ``node_id``."""
        return {c.local_name: c.node_id for c in self.graph.nodes[node_id].children}

    def value_key(self, node_id: int) -> str | None:
        for attribute in self.graph.nodes[node_id].attributes:
            if attribute.name == tf_compat.VARIABLE_VALUE:
                return attribute.checkpoint_key
        return None

    def read(self, node_id: int) -> np.ndarray:
        key = self.value_key(node_id)
        if key is None:
            raise CorruptCheckpointError(
                f"{self.path}: object graph node {node_id} should be a variable but has no "
                f"saved value; the directory is damaged. Received: node {node_id}"
            )
        try:
            return np.asarray(self.reader.get_tensor(key))
        except Exception as error:  # tf.errors.*: a damaged or truncated variables file
            raise CorruptCheckpointError(
                f"{self.path}: the value of {key} cannot be read from the variables "
                f"checkpoint ({type(error).__name__}: {error}); the directory is damaged. "
                f"Received: {key!r}"
            ) from error

    def listed(self, node_id: int, attribute: str) -> list[int]:
        """The node ids of the list a layer tracks as ``attribute`` (``variables``), in
        their recorded order."""
        list_id = self.children(node_id).get(attribute)
        if list_id is None:
            return []
        items = self.children(list_id)
        return [items[k] for k in sorted(items, key=_index) if k.isdigit()]

    def saved_variables(self) -> dict[int, Any]:
        """Node id -> ``SavedVariable`` (``name``, ``trainable``: the variable's own flag,
        whatever its layer's) of every variable of ``saved_model.pb``'s object graph, whose
        node ids are the checkpoint's. Parsed once."""
        if self._saved_variables is None:
            self._saved_variables = _saved_variables(self.path / SAVED_MODEL_FILE)
        return self._saved_variables

    def variable_name(self, node_id: int) -> str:
        key = self.value_key(node_id) or ""
        return key.split("/.ATTRIBUTES")[0]


def _saved_variables(file: Path) -> dict[int, Any]:
    from tensorflow.core.protobuf import saved_model_pb2

    try:
        saved = saved_model_pb2.SavedModel.FromString(file.read_bytes())
        nodes = saved.meta_graphs[0].object_graph_def.nodes
    except Exception as error:  # DecodeError, IndexError: an unreadable file
        raise CorruptCheckpointError(
            f"{file} cannot be read as a SavedModel ({type(error).__name__}: {error}); the "
            f"file is damaged. Received: {str(file)!r}"
        ) from error
    return {i: n.variable for i, n in enumerate(nodes) if n.WhichOneof("kind") == "variable"}


def _index(key: str) -> int:
    return int(key) if key.isdigit() else -1


def open_legacy(path: Path) -> LegacyDir:
    """Parse ``path``; a damaged file is a ``CorruptCheckpointError`` naming it."""
    path = Path(path)
    if not is_legacy(path):
        raise NotACheckpointError(
            f"{path} is not a legacy tf.keras SavedModel: it needs {SAVED_MODEL_FILE} and "
            f"{METADATA_FILE}. Pass the directory tf.keras' model.save wrote. "
            f"Received: {str(path)!r}"
        )
    meta_file = path / METADATA_FILE
    limits.check_text_size(meta_file.stat().st_size, "legacy Keras metadata", path)
    try:
        parsed = SavedMetadata.FromString(meta_file.read_bytes())
        nodes = {}
        for item in parsed.nodes:
            metadata = json.loads(item.metadata) if item.metadata else {}
            nodes[item.node_id] = Node(item.node_id, item.node_path, item.identifier, metadata)
    except Exception as error:  # protobuf DecodeError, JSON errors: an unreadable file
        raise CorruptCheckpointError(
            f"{meta_file} cannot be read as tf.keras metadata ({type(error).__name__}: "
            f"{error}); the file is damaged. Received: {str(meta_file)!r}"
        ) from error
    try:
        reader, graph = tf_compat.read_checkpoint(str(path / "variables" / "variables"))
    except Exception as error:  # NotFoundError, DataLossError, DecodeError
        raise CorruptCheckpointError(
            f"{path}/variables cannot be read as the SavedModel's checkpoint "
            f"({type(error).__name__}: {error}); the directory is damaged or incomplete. "
            f"Received: {str(path)!r}"
        ) from error
    legacy = LegacyDir(path, nodes, graph, reader)
    legacy.by_path = {node.path: node for node in nodes.values()}
    if "root" not in legacy.by_path or legacy.root.identifier not in _MODEL_IDS:
        found = legacy.by_path.get("root")
        raise CorruptCheckpointError(
            f"{path}: the root of {METADATA_FILE} is not a Keras model, so there is no model "
            f"to import. Received: {found.identifier if found else 'no root node'!r}"
        )
    return legacy


_MODEL_IDS = ("_tf_keras_network", "_tf_keras_model", "_tf_keras_sequential")


def layer_node(legacy: LegacyDir, parent: Node, attribute: str) -> Node | None:
    """The Keras node reached from ``parent`` through ``attribute`` (object path)."""
    child = legacy.children(parent.node_id).get(attribute)
    return legacy.nodes.get(child) if child is not None else None


def top_level_layers(legacy: LegacyDir) -> dict[str, Node]:
    """Layer name -> node for the layers the root model tracks as ``layer-<i>``."""
    return model_layers(legacy, legacy.root)


def model_layers(legacy: LegacyDir, model: Node) -> dict[str, Node]:
    """Layer name -> node for the layers a (Functional or Sequential) model node tracks as
    ``layer-<i>``."""
    found = {}
    for attribute, node_id in legacy.children(model.node_id).items():
        node = legacy.nodes.get(node_id)
        if attribute.startswith("layer-") and node is not None:
            found[node.metadata.get("name")] = node
    return found


GRAPH_CLASSES = ("Functional", "Model", "Sequential")


def every_layer(legacy: LegacyDir) -> dict[str, Node]:
    """Every layer of the root model and of the Functional and Sequential models nested in
    it, by qualified name (``inner_model/layer``), parents before their layers."""
    found: dict[str, Node] = {}

    def walk(model: Node, prefix: str) -> None:
        for name, node in model_layers(legacy, model).items():
            found[f"{prefix}{name}"] = node
            graph = node.metadata.get("class_name") in GRAPH_CLASSES
            if graph and node.identifier in _MODEL_IDS:
                walk(node, f"{prefix}{name}/")

    walk(legacy.root, "")
    return found
