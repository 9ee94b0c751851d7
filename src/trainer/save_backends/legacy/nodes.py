"""Keras 2 Functional call graphs (``inbound_nodes``) -> what Keras 3 rebuilds them from.

Keras 3 reads Keras 2's list form of a node, ``[[name, node_index, tensor_index, kwargs],
...]``, but passes ``kwargs`` to the call as they are, so a tensor Keras 2 recorded in them
(``MultiHeadAttention``'s ``value`` or ``attention_mask``, an RNN's ``initial_state``) would
arrive as a ``[name, node_index, tensor_index]`` list; and it numbers a nested model's calls
from 0 where Keras 2 counted from 1.
"""

from __future__ import annotations

from typing import Any


def _skips_first_node(entry: dict[str, Any]) -> bool:
    """Keras 2 gave a nested Functional model (and a Sequential starting with an
    ``InputLayer``) a node of its own when it was built, and its config counts the calls in
    the outer graph from 1; Keras 3 gives it none and counts from 0."""
    if entry.get("class_name") in ("Functional", "Model"):
        return True
    if entry.get("class_name") == "Sequential":
        inner = (entry.get("config") or {}).get("layers") or [{}]
        return inner[0].get("class_name") == "InputLayer"
    return False


def renumber_nested_model_nodes(config: dict[str, Any], layers: list[dict[str, Any]]) -> None:
    """References ``[name, node_index, tensor_index, ...]`` to such nested models, in the
    layers' ``inbound_nodes`` and the model's ``output_layers``, renumbered for Keras 3.
    (The entries are already translated: a Keras 2 Sequential's ``InputLayer`` is kept.)"""
    shifted = {
        (entry.get("config") or {}).get("name") for entry in layers if _skips_first_node(entry)
    }
    if not shifted:
        return

    def renumber(value: Any) -> Any:
        if isinstance(value, list):
            if len(value) >= 3 and _is_reference(value[:3], shifted):
                return [value[0], max(value[1] - 1, 0), *value[2:]]
            return [renumber(v) for v in value]
        if isinstance(value, dict):
            return {k: renumber(v) for k, v in value.items()}
        return value

    for entry in layers:
        if "inbound_nodes" in entry:
            entry["inbound_nodes"] = renumber(entry["inbound_nodes"])
    if "output_layers" in config:
        config["output_layers"] = renumber(config["output_layers"])


def resolve_tensor_arguments(layers: list[dict[str, Any]]) -> None:
    """Nodes whose call kwargs hold tensors, rewritten in Keras 3's own node form
    (``{"args", "kwargs"}`` with ``__keras_tensor__`` references), which it resolves like the
    first argument; other nodes are left in the list form. Keras 2 wrote such a tensor as
    ``[layer_name, node_index, tensor_index]`` (tf_keras ``Node.serialize``), and read back as
    one any list of that form naming a layer of the model."""
    names = {(entry.get("config") or {}).get("name") for entry in layers}
    for entry in layers:
        found = entry.get("inbound_nodes")
        if isinstance(found, list):
            entry["inbound_nodes"] = [_node(node, names) for node in found]


def _node(node: Any, names: set[Any]) -> Any:
    calls = node if isinstance(node, list) else []
    if not calls or not all(_is_reference(c, names, (3, 4)) for c in calls):
        return node  # Keras 3's form already, a constant argument, or nothing to resolve
    kwargs = calls[-1][3] if len(calls[-1]) == 4 else {}  # every entry carries the same
    if not _holds_reference(kwargs, names):
        return node
    first = [_keras_tensor(call[:3]) for call in calls]
    return {
        "args": [first[0] if len(first) == 1 else first],
        "kwargs": _with_tensors(kwargs, names),
    }


def _is_reference(value: Any, names: set[Any], lengths: tuple[int, ...] = (3,)) -> bool:
    return (
        isinstance(value, list)
        and len(value) in lengths
        and isinstance(value[0], str)
        and value[0] in names
        and isinstance(value[1], int)
        and isinstance(value[2], int)
    )


def _holds_reference(value: Any, names: set[Any]) -> bool:
    if _is_reference(value, names):
        return True
    if isinstance(value, dict):
        return any(_holds_reference(v, names) for v in value.values())
    if isinstance(value, list):
        return any(_holds_reference(v, names) for v in value)
    return False


def _with_tensors(value: Any, names: set[Any]) -> Any:
    if _is_reference(value, names):
        return _keras_tensor(value)
    if isinstance(value, dict):
        return {k: _with_tensors(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_tensors(v, names) for v in value]
    return value


def _keras_tensor(reference: list[Any]) -> dict[str, Any]:
    """A Keras 3 reference to output ``tensor_index`` of call ``node_index`` of a layer. Its
    shape and dtype only describe the placeholder, which Keras 3 replaces by that output."""
    return {
        "class_name": "__keras_tensor__",
        "config": {"shape": [], "dtype": "float32", "keras_history": list(reference)},
    }
