"""Revival of Functional and Sequential models: their layers first, then Keras' own graph.

A graph model is rebuilt by Keras from its saved config, with each layer entry pointing at
the layer the :class:`~trainer.save_backends.savedmodel.load.revival.Reviver` revived for it
(from its class or from its traced functions): ``TOKEN`` names stand in for the classes in
the config and return the revived layers. The same substitution lets a known wrapper hold
an unknown inner layer (``substituted``). Split from ``revival`` to keep each module to
one concern; the functions take the reviver, whose public methods they use.
"""

from __future__ import annotations

import copy
from typing import Any

import keras

from trainer.errors import CorruptCheckpointError
from trainer.model_state.rebuild import rebuild_error
from trainer.save_backends.savedmodel.features.training_logic import COMPUTATION
from trainer.save_backends.savedmodel.records import PLACEHOLDER

TOKEN = "__trainer_revived_{}__"


class _Prebuilt:
    """Stands in for a class in a config: ``from_config`` returns an existing layer."""

    def __init__(self, layer: keras.layers.Layer):
        self.layer = layer

    def from_config(self, config: Any) -> keras.layers.Layer:
        return self.layer


def substituted(reviver: Any, record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config with each child's nested config replaced by a reference to the
    child revived separately (lets a known Wrapper hold an unknown inner layer)."""
    extra: dict[str, Any] = {}
    children = {}
    for child in record["sublayers"]:
        child_record = reviver.records[child["id"]]
        children[(child_record["class_name"], child_record["name"])] = child["id"]

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            inner = node.get("config")
            name = inner.get("name") if isinstance(inner, dict) else None
            key = (node.get("class_name"), name)
            if key in children:
                token = TOKEN.format(children[key])
                extra[token] = _Prebuilt(reviver.revive(children[key]))
                return {**node, "class_name": token, "registered_name": token, "config": {}}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    config = record["keras_config"]
    return {**config, "config": walk(config["config"])}, extra


def rebuild_graph(reviver: Any, record: dict[str, Any]) -> keras.layers.Layer | None:
    """Functional/Sequential: layers first, then Keras' own graph reconstruction. A
    subclass missing here is rebuilt as a plain Functional/Sequential if it computes what
    its graph does; None if it overrides ``call`` (or another ``COMPUTATION`` method):
    then it is revived from its traced functions, which hold what it computed."""
    extra: dict[str, Any] = {}
    config = copy.deepcopy(record["keras_config"])
    entries = config["config"]["layers"]
    for entry, child in zip(entries, _graph_children(reviver, record, entries), strict=True):
        if child is None:
            if isinstance(entry.get("config"), dict) and PLACEHOLDER in entry["config"]:
                raise CorruptCheckpointError(
                    f"{reviver.where}: the graph of {record['name']!r} holds a placeholder "
                    f"for a layer without config, but no saved layer matches it. The "
                    f"checkpoint is damaged; load an older one. Received: {entry!r}"[:600]
                )
            continue
        token = TOKEN.format(child)
        extra[token] = _Prebuilt(reviver.revive(child))
        entry.update(class_name=token, registered_name=token, module=None)
    try:
        model = reviver.deserialize(config, extra)
    except (TypeError, ValueError) as err:  # what Keras raises for a class it cannot locate
        if "Could not locate" not in str(err):
            raise _graph_error(reviver, record, err) from err
        if _computes_otherwise(record):
            return None
        # A registered Functional subclass whose class is missing: plain Functional.
        base = keras.Sequential if record["model_kind"] == "sequential" else keras.Model
        with keras.saving.custom_object_scope({**reviver.custom_objects, **extra}):
            model = base.from_config(config["config"])
        reviver.plain_graphs.add(record["name"])
    reviver.bind(model, record, strict=True)
    reviver.how[record["name"]] = "graph"
    return model


def _computes_otherwise(record: dict[str, Any]) -> bool:
    """Whether the record says its class overrides what its graph computes (checkpoints
    written before this was recorded say nothing)."""
    stored = record.get("computation_overrides")
    return isinstance(stored, list) and any(m in COMPUTATION for m in stored)


def _graph_error(reviver: Any, record: dict[str, Any], err: Exception) -> Exception:
    """Why a graph found all its classes and still did not rebuild: a class's own code
    (``RebuildError``), or the graph itself failing around its revived layers."""
    rebuilt = rebuild_error(err, reviver.where, f"model {record['name']!r}")
    if rebuilt is not None:
        return rebuilt
    traced = sorted(name for name, how in reviver.how.items() if how == "traced")
    advice = (
        "Pass the missing classes in custom_objects, or load an older checkpoint"
        if traced
        else "The checkpoint is damaged or was edited; load an older checkpoint"
    )
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # Keras wraps the real error
    return CorruptCheckpointError(
        f"{reviver.where}: the graph of model {record['name']!r} could not be rebuilt from "
        f"its config around its layers (revived from traced functions: {traced or 'none'}"
        f"). {advice}. Received: {type(cause).__name__}: {str(cause)[:400]}"
    )


def _graph_children(
    reviver: Any, record: dict[str, Any], entries: list[dict[str, Any]]
) -> list[int | None]:
    """The saved layer of each graph entry: by name, or for a Sequential whose layer's
    config has no name (its own get_config leaves it out), by position."""
    by_name = {reviver.records[c["id"]]["name"]: c["id"] for c in record["sublayers"]}
    found: list[int | None] = []
    for entry in entries:
        inner = entry.get("config")
        name = entry.get("name") or (inner.get("name") if isinstance(inner, dict) else None)
        found.append(by_name.get(name))
    if record["model_kind"] == "sequential":
        unique = list(dict.fromkeys(c["id"] for c in record["sublayers"]))
        if len(unique) == len(entries):
            for position, (entry, child) in enumerate(zip(entries, unique, strict=True)):
                same_class = reviver.records[child]["class_name"] == entry.get("class_name")
                if found[position] is None and same_class:
                    found[position] = child
    return found
