"""Import only the traced functions a revival needs, not the SavedModel's whole library.

When some layers must be revived from their traced functions (class missing, ``Lambda`` in
safe mode, ...), ``tf.saved_model.load`` would import every function of the library: for a
deep model mostly the ``call_infer`` / ``call_train`` of layers that are rebuilt from their
classes and never call them. Here a pruned copy of ``saved_model.pb`` is built in memory:
the object-graph nodes of the layers that need their functions (with their sublayers,
variables and whatever their functions capture), the other layers' function edges cut, and
the function library reduced to the functions those nodes call (with their dependencies
and gradients). TensorFlow's loader imports that copy from the real directory (assets
resolve as usual; nothing is written anywhere), without reading the checkpoint: the values
come from :mod:`stored_variables`, by the same position in the root's ``model_variables``.

Anything the pruning does not understand (checkpointed state that is not a variable of
``model_variables``, slot variables, a capture outside every loadable path) makes
:func:`plan` return ``None``, and the caller imports the SavedModel in full.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import keras
from tensorflow.core.protobuf import saved_model_pb2, saved_object_graph_pb2

from trainer._compat import tensorflow as tf_compat
from trainer.save_backends.savedmodel.load.stored_variables import StoredVariables, root_list
from trainer.save_backends.savedmodel.records import is_graph_config

_FUNCTION_KINDS = ("function", "bare_concrete_function")
# Children of a layer node that hold traced functions (cut for layers rebuilt from class).
_FUNCTION_LISTS = ("regularizer_functions",)


class Plan:
    """The pruned SavedModel and the node paths to load from it."""

    def __init__(
        self, proto: Any, filters: list[str], layer_ids: dict[int, int], var_nodes: list[int]
    ) -> None:
        self.proto = proto
        self.filters = filters
        self.layer_ids = layer_ids  # layer record index -> node id, for layers with functions
        self.var_nodes = var_nodes  # node id of each model variable, by position
        self.functions = len(proto.meta_graphs[0].graph_def.library.function)


class PartialLoad:
    """What a :class:`Reviver` needs: a node per layer (``None`` where the functions were
    not imported) and per model variable a loaded ``tf.Variable`` or a stored entry."""

    def __init__(self, nodes: list[Any], storage: list[Any], keep_alive: Any, functions: int):
        self.nodes = nodes
        self.storage = storage
        self.keep_alive = keep_alive
        self.functions_imported = functions


def _kind(nodes: Any, node_id: int) -> str:
    return nodes[node_id].WhichOneof("kind")


def _concrete_names(node: Any) -> list[str]:
    kind = node.WhichOneof("kind")
    if kind == "function":
        return list(node.function.concrete_functions)
    if kind == "bare_concrete_function":
        return [node.bare_concrete_function.concrete_function_name]
    return []


class _Closure:
    """The nodes to load starting from some layer nodes, with the cut function edges."""

    def __init__(self, graph: Any, layer_nodes: list[int], wanted: set[int]):
        self.graph = graph
        self.nodes = graph.nodes
        self.all_layers = set(layer_nodes)
        self.wanted = wanted  # layer node ids whose functions are imported
        self.kept: set[int] = set()
        self.cut: dict[int, list[int]] = {}  # layer node id -> positions of cut children
        self.functions: set[str] = set()

    def _cuts(self, node_id: int, child: Any) -> bool:
        if node_id not in self.all_layers or node_id in self.wanted:
            return False
        return (
            _kind(self.nodes, child.node_id) in _FUNCTION_KINDS
            or child.local_name in _FUNCTION_LISTS
        )

    def add(self, start: list[int]) -> list[int]:
        """Keep ``start`` and its descendants; returns the captured node ids not kept yet."""
        stack = list(start)
        captured: list[int] = []
        while stack:
            node_id = stack.pop()
            if node_id in self.kept:
                continue
            self.kept.add(node_id)
            node = self.nodes[node_id]
            for position, child in enumerate(node.children):
                if self._cuts(node_id, child):
                    self.cut.setdefault(node_id, []).append(position)
                else:
                    stack.append(child.node_id)
            for name in _concrete_names(node):
                self.functions.add(name)
                saved = self.graph.concrete_functions.get(name)
                captured.extend(saved.bound_inputs if saved is not None else [])
        return [c for c in captured if c not in self.kept]

    def supported(self, model_variables: set[int]) -> bool:
        """Whether skipping the checkpoint loses nothing: every kept node with checkpointed
        state is a variable of ``model_variables`` (assigned from the stored values)."""
        for node_id in self.kept:
            node = self.nodes[node_id]
            if node.slot_variables or node.saveable_objects or node.registered_saver:
                return False
            if node.WhichOneof("kind") == "variable" and node_id not in model_variables:
                return False
        return True


def _paths(graph: Any, cut: dict[int, list[int]]) -> dict[int, str]:
    """A path from the root to every node reachable without the cut edges."""
    found = {0: "root"}
    queue = deque([0])
    while queue:
        node_id = queue.popleft()
        skipped = set(cut.get(node_id, ()))
        for position, child in enumerate(graph.nodes[node_id].children):
            if position not in skipped and child.node_id not in found:
                found[child.node_id] = f"{found[node_id]}.{child.local_name}"
                queue.append(child.node_id)
    return found


def _function_deps(library: Any, names: set[str]) -> set[str]:
    """``names`` and every library function they call (op or function-valued attribute)."""
    by_name = {f.signature.name: f for f in library.function}
    gradients = {g.function_name: g.gradient_func for g in library.gradient}
    keep: set[str] = set()
    stack = [n for n in names if n in by_name]
    stack.extend(g.gradient_func for g in library.registered_gradients if g.gradient_func)
    while stack:
        name = stack.pop()
        if name in keep or name not in by_name:
            continue
        keep.add(name)
        if name in gradients:
            stack.append(gradients[name])
        for node_def in by_name[name].node_def:
            if node_def.op in by_name:
                stack.append(node_def.op)
            for value in node_def.attr.values():
                if value.HasField("func"):
                    stack.append(value.func.name)
                stack.extend(f.name for f in value.list.func)
    return keep


def _pruned_proto(source: Any, closure: _Closure, functions: set[str]) -> Any:
    """A SavedModel holding the original object graph with the cut edges removed and only
    ``functions`` in its library (the loader imports the whole library it is given)."""
    meta = source.meta_graphs[0]
    proto = saved_model_pb2.SavedModel()
    out = proto.meta_graphs.add()
    out.asset_file_def.extend(meta.asset_file_def)
    out.graph_def.node.extend(meta.graph_def.node)
    out.graph_def.versions.CopyFrom(meta.graph_def.versions)
    library = meta.graph_def.library
    out.graph_def.library.function.extend(
        f for f in library.function if f.signature.name in functions
    )
    out.graph_def.library.gradient.extend(
        g for g in library.gradient if g.function_name in functions
    )
    out.graph_def.library.registered_gradients.extend(library.registered_gradients)
    graph = saved_object_graph_pb2.SavedObjectGraph()
    graph.CopyFrom(meta.object_graph_def)
    for node_id, positions in closure.cut.items():
        children = graph.nodes[node_id].children
        kept = [c for i, c in enumerate(children) if i not in set(positions)]
        del children[:]
        children.extend(kept)
    # A saved custom gradient keeps its entry: without it, the loader calls the gradient
    # function with flat outputs that do not line up with its op's inputs (TensorFlow
    # failed with "Function instantiation included invalid output index").
    gradients = {g.gradient_func for g in library.registered_gradients}
    for name in list(graph.concrete_functions):
        if name not in closure.functions and name not in gradients:
            del graph.concrete_functions[name]
    out.object_graph_def.CopyFrom(graph)
    return proto


def plan(source: Any, layer_ids: set[int]) -> Plan | None:
    """The pruned SavedModel for reviving layers ``layer_ids`` (record indices) from their
    traced functions, or ``None`` if this SavedModel cannot be pruned safely."""
    graph = source.meta_graphs[0].object_graph_def
    try:
        layer_nodes = root_list(graph.nodes, "layer_nodes")
        var_nodes = root_list(graph.nodes, "model_variables")
    except (KeyError, IndexError):
        return None
    wanted = {layer_nodes[i]: i for i in sorted(layer_ids)}
    closure = _Closure(graph, layer_nodes, set(wanted))
    captured = closure.add(list(wanted))
    extra: list[int] = []
    while captured:  # functions capturing nodes outside the layers' subtrees
        extra.extend(captured)
        captured = closure.add(captured)
    if not closure.supported(set(var_nodes)):
        return None
    paths = _paths(graph, closure.cut)
    var_paths = {n: f"root.model_variables.{k}" for k, n in enumerate(var_nodes)}
    filters = [f"root.layer_nodes.{i}" for i in wanted.values()]
    for node_id in dict.fromkeys(extra):
        path = var_paths.get(node_id) or paths.get(node_id)
        if path is None:
            return None
        filters.append(path)
    functions = _function_deps(source.meta_graphs[0].graph_def.library, closure.functions)
    if not closure.functions <= functions:
        return None  # a concrete function the object graph names is not in the library
    layers = {i: n for n, i in wanted.items()}
    return Plan(_pruned_proto(source, closure, functions), filters, layers, var_nodes)


def load(directory: Path, prepared: Plan, count: int, stored: StoredVariables) -> PartialLoad:
    """Import ``prepared`` from ``directory`` (``count`` layer records) and give its
    variables their stored values. Raises what TensorFlow's loader or an assign raises."""
    loader = tf_compat.load_pruned_saved_model(prepared.proto, str(directory), prepared.filters)
    nodes: list[Any] = [None] * count
    for index, node_id in prepared.layer_ids.items():
        nodes[index] = loader.get(node_id)
    storage: list[Any] = []
    for position, node_id in enumerate(prepared.var_nodes):
        loaded = loader.get(node_id)
        entry = stored.model[position]
        if loaded is None:
            storage.append(entry)
        else:
            loaded.assign(stored.value(entry))
            storage.append(loaded)
    return PartialLoad(nodes, storage, loader, prepared.functions)


def predict_traced(
    records: list[dict[str, Any]], custom_objects: dict[str, Any], safe_mode: bool
) -> set[int]:
    """The layers likely to be revived from their traced functions: no config, code in a
    config under safe mode, a subclassed model (called on its traced specs), or a class
    that is neither Keras' own nor registered nor in ``custom_objects``. A wrong guess only
    costs time: a layer guessed here is still rebuilt from its class if it can be, and one
    missed here makes the reviver ask for it (the caller then loads again with it)."""
    registered = keras.saving.get_custom_objects()
    guessed = set()
    for record in records:
        config = record.get("keras_config")
        if not record.get("functions") or is_graph_config(record["model_kind"], config):
            continue
        if config is None or (record["carries_code"] and safe_mode):
            guessed.add(record["id"])
            continue
        module = str(config.get("module") or "")
        names = {config.get("registered_name"), config.get("class_name")} - {None}
        known = module == "keras" or module.startswith("keras.")
        found = any(n in registered or n in custom_objects for n in names)
        if record["model_kind"] == "subclassed" or not (known or found):
            guessed.add(record["id"])
    return guessed
