"""Revival: from a loaded SavedModel and its per-layer records back to a Keras 3 model.

Order and choices, per layer (parents ask for their children, so nesting is handled by
recursion and shared layers come back once):

1. Functional / Sequential: revive every layer of the graph first, then let Keras rebuild
   the graph from the saved config with each layer entry pointing at the revived layer.
2. Class available (built-in, registered, ``custom_objects``) and its config carries no
   Python code (or ``safe_mode=False``): rebuild from config.
3. Otherwise, or if 2 fails: a revived layer calling the traced functions.

Every Keras variable of the result is then pointed at the loaded ``tf.Variable`` storage
(by position within the layer), so values need no copy and a parent revived from traced
functions sees the same storage as a child rebuilt from config.

A reviver without traced functions (``nodes=None``, the storage read from the variables
checkpoint without ``tf.saved_model.load``) revives layers from their classes only and
assigns the stored values; it raises :class:`NeedsTracedFunctions` as soon as a layer
would need a traced function (or one storage shared by two rebuilt variables, which
assigning cannot express), and the caller then imports the functions it needs. A reviver
can also hold some nodes only (``None`` for the others, see ``partial_load``): storage
entries that are ``stored_variables.Stored`` get their values assigned, loaded
``tf.Variable`` entries are shared as with a full load.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import tensorflow as tf_compat
from trainer.errors import CorruptCheckpointError, MissingClassError
from trainer.model_state import json_tuples
from trainer.model_state.rebuild import rebuild_error
from trainer.save_backends.savedmodel import layout
from trainer.save_backends.savedmodel.features import (
    constraints,
    restored_loops,
    rnn_states,
    standins,
)
from trainer.save_backends.savedmodel.load import graph_revival, symbolic_build
from trainer.save_backends.savedmodel.load.stored_variables import Stored
from trainer.save_backends.savedmodel.records import is_graph_config, rebuilt_order

log = logging.getLogger(__name__)


class NeedsTracedFunctions(Exception):
    """A reviver without traced functions met a layer that needs them (internal: the
    backend catches it and imports that layer's functions, ``layer_id`` its record)."""

    def __init__(self, message: str, layer_id: int):
        super().__init__(message)
        self.layer_id = layer_id


def _check_record_ids(records: list[dict[str, Any]], where: str) -> None:
    """Every layer record's ``id`` is its position, and its children name records that
    exist: an ``id`` is joined into paths inside the checkpoint (its vocabulary folder),
    and one edited into ``../../elsewhere`` read a vocabulary from outside it (the layer
    then mapped every token differently, without an error)."""
    for index, record in enumerate(records):
        children = record.get("sublayers", []) if isinstance(record, dict) else None
        ids = [c.get("id") if isinstance(c, dict) else None for c in children or []]
        if (
            not isinstance(record, dict)
            or record.get("id") != index
            or isinstance(record.get("id"), bool)
            or not isinstance(children, list)
            or not all(type(i) is int and 0 <= i < len(records) for i in ids)
        ):
            raise CorruptCheckpointError(
                f"{where}: layer record {index} is damaged: its id must be its position "
                f"({index}) and its sublayers must name records 0..{len(records) - 1}. Load "
                f"another checkpoint. Received: id={_short(record)}, sublayers={ids!r:.200}"
            )


def _short(record: Any) -> str:
    return repr(record.get("id") if isinstance(record, dict) else record)[:100]


class Reviver:
    def __init__(
        self,
        storage: Sequence[Any],
        nodes: Sequence[Any] | None,
        records: list[dict[str, Any]],
        variables: list[dict[str, Any]],
        *,
        custom_objects: dict[str, Any],
        safe_mode: bool,
        where: str,
        directory: Any = None,
    ):
        self.directory = Path(directory or where)
        self.records = records
        self.var_records = variables
        self.storage = list(storage)
        self.nodes = list(nodes) if nodes is not None else [None] * len(records)
        self.with_functions = any(node is not None for node in self.nodes)
        self.custom_objects = dict(custom_objects)
        self.safe_mode = safe_mode
        self.where = where
        self.layers: dict[int, keras.layers.Layer] = {}
        self.keras_vars: dict[int, keras.Variable] = {}
        self.how: dict[str, str] = {}  # layer name -> "config" | "graph" | "traced"
        # Graph models of a subclass missing here, rebuilt as a plain Functional/Sequential
        self.plain_graphs: set[str] = set()
        self.functions_imported = 0  # library functions imported for this load
        self.config_errors: dict[int, Exception] = {}  # why a layer was not rebuilt
        if len(self.storage) != len(variables) or len(self.nodes) != len(records):
            raise CorruptCheckpointError(
                f"{where}: the object graph holds {len(self.storage)} variables and "
                f"{len(self.nodes)} layer nodes but the metadata lists {len(variables)} and "
                f"{len(records)}. The metadata belongs to another save; re-save the model."
            )
        _check_record_ids(records, where)

    # ------------------------------------------------------------------ entry point
    def revive(self, index: int = 0) -> keras.layers.Layer:
        if index in self.layers:
            return self.layers[index]
        record = self.records[index]
        layer = None
        if _is_graph_config(record):
            layer = graph_revival.rebuild_graph(self, record)  # None: revive from traces
        elif self._config_allowed(record):
            layer = self._from_config(record)
        if layer is None:
            if record["model_kind"] in ("functional", "sequential"):
                self._refuse_failing_class(record)
            layer = self._from_functions(record)
        self.layers[index] = layer
        return layer

    def _refuse_failing_class(self, record: dict[str, Any]) -> None:
        """A Functional subclass whose class is given but fails to rebuild from its config
        is that class's error (``RebuildError``), not a reason to revive it from traces:
        only a missing class is."""
        failure = self.config_errors.get(record["id"])
        if failure is None or "Could not locate" in str(failure):
            return
        rebuilt = rebuild_error(failure, self.where, f"model {record['name']!r}")
        if rebuilt is not None:
            raise rebuilt from failure

    # ------------------------------------------------------------------- strategies
    def _config_allowed(self, record: dict[str, Any]) -> bool:
        if record["keras_config"] is None:
            return False
        return not (record["carries_code"] and self.safe_mode)

    def deserialize(self, config: dict[str, Any], extra: dict[str, Any]) -> Any:
        objects = {**self.custom_objects, **extra}
        with keras.saving.custom_object_scope(objects):
            return keras.saving.deserialize_keras_object(
                json_tuples.restore(config), custom_objects=objects, safe_mode=self.safe_mode
            )

    def _from_config(self, record: dict[str, Any]) -> keras.layers.Layer | None:
        config = record["keras_config"]
        attempts = [(config, {})]
        if record["sublayers"]:
            attempts.append(graph_revival.substituted(self, record))
        fault = None
        for cfg, extra in attempts:
            try:
                cfg = copy.deepcopy(cfg)
                cfg.pop("build_config", None)
                layer = self.deserialize(cfg, extra)
                with keras_compat.name_scopes(self._saved_scopes(record)):
                    self._build(layer, record)
                if self.bind(layer, record, strict=False):
                    self._bind_states(layer, record)
                    self._load_vocabulary(layer, record)
                    self._adopt_children(layer, record)
                    self.how[record["name"]] = "config"
                    return layer
                reason = "its rebuilt variables do not match the saved ones"
            except NeedsTracedFunctions:
                raise
            except Exception as err:  # unknown class, failing from_config, ...
                reason = f"{type(err).__name__}: {str(err)[:200]}"
                self.config_errors[record["id"]] = err
                fault = fault or rebuild_error(err, self.where, f"layer {record['name']!r}")
            log.info("Layer %r not rebuilt from config (%s)", record["name"], reason)
        self._require_functions(record, "not rebuilt from its config")
        if fault is not None:
            # The class was found but its own code cannot rebuild it: the layer is revived
            # from its traced functions (same outputs and training, not the class's Python
            # methods). A warning, since the user expected their class.
            log.warning("%s Revived from its traced functions instead.", fault)
        return None

    def _saved_scopes(self, record: dict[str, Any]) -> list[str]:
        """The name scopes the saved layer's variables were created under, above the layer
        itself (``["outer"]`` for ``outer/head/kernel`` of layer ``head``): a layer held by a
        subclassed model was built inside its parent's scope, and rebuilt here it must be
        too, or every ``variable.path`` loses its parent's prefix."""
        for index in record["variables"]:
            parts = str(self.var_records[index].get("path") or "").split("/")
            if record["name"] in parts[:-1]:
                return parts[: parts.index(record["name"])]
        return []

    def _build(self, layer: keras.layers.Layer, record: dict[str, Any]) -> None:
        """Build like Keras would: a layer without ``build()`` of its own by a symbolic call
        on the shapes its build config records (``symbolic_build``), any other layer from
        its build config. If that leaves weights missing (layers creating sublayer weights
        lazily in ``call``), build by a symbolic call with the traced input specs, as the
        original was built by the functional API."""
        built_from_config = False
        if not layer.built and record.get("build_config"):
            with contextlib.suppress(Exception):
                if symbolic_build.builds_by_call(layer):
                    symbolic_build.build_by_call(layer, record["build_config"])
                else:
                    layer.build_from_config(record["build_config"])
                    built_from_config = True
        if len(layer.variables) != len(record["variables"]):
            self._require_functions(record, "built by a call on its traced input specs")
            self._call_symbolically(layer, record, rebuild=True)
            return
        if built_from_config:
            # As Keras' own loading does: a model's default build_from_config builds its
            # sublayers by running its call, which does not mark the model itself built.
            layer.built = True
        if record["model_kind"] == "subclassed":
            # A subclassed model takes its input signature (serving, saving it again)
            # from its first call; the saved one had been called, so this one is too.
            self._require_functions(record, "called on its traced input specs")
            with contextlib.suppress(Exception):
                self._call_symbolically(layer, record)

    def _call_symbolically(
        self, layer: keras.layers.Layer, record: dict[str, Any], *, rebuild: bool = False
    ) -> None:
        """Call ``layer`` on symbolic inputs of the specs its traced call recorded (after
        marking it unbuilt if ``rebuild``, so that the call builds it)."""
        function = getattr(self.nodes[record["id"]], "call_infer", None)
        concretes = tf_compat.concrete_functions(function) if function else []
        if not concretes:
            return
        if rebuild:
            layer.built = False
        args, kwargs = concretes[0].structured_input_signature[0]
        symbolic_build.call(layer, *symbolic_build.inputs_from_specs(args, kwargs))

    def _load_vocabulary(self, layer: keras.layers.Layer, record: dict[str, Any]) -> None:
        words = layout.read_vocabulary(
            layout.vocabulary_folder(self.directory, record["id"]), layer
        )
        if words is None or not hasattr(layer, "set_vocabulary"):
            return
        if record["keras_config"].get("config", {}).get("output_mode") in ("tf_idf", "tf-idf"):
            # Its vocabulary needs its IDF weights with it: those it has (from its config),
            # or none yet, and both come back with its layer state (layer_state.restore).
            idf = getattr(layer, "idf_weights_const", None)
            if idf is not None:
                layer.set_vocabulary(words, idf_weights=idf)
            return
        layer.set_vocabulary(words)

    def _require_functions(self, record: dict[str, Any], why: str) -> None:
        if self.nodes[record["id"]] is None:
            raise NeedsTracedFunctions(f"layer {record['name']!r}: {why}", record["id"])

    def _from_functions(self, record: dict[str, Any]) -> keras.layers.Layer:
        self._require_functions(record, "revived from its traced functions")
        node = self.nodes[record["id"]]
        if "call_infer" not in record["functions"]:
            failure = self.config_errors.get(record["id"])
            if failure is not None and "Could not locate" not in str(failure):
                rebuilt = rebuild_error(failure, self.where, f"layer {record['name']!r}")
                if rebuilt is not None:  # the class is here but its own code fails
                    raise rebuilt from failure
            reason = record.get("config_error") or "class not found, or not allowed in safe mode"
            raise MissingClassError(
                f"{self.where}: layer {record['name']!r} of class {record['class_name']!r} "
                f"cannot be rebuilt from its config ({reason}) "
                f"and has no traced call function. Pass the class in custom_objects (or "
                f"register it with keras.saving.register_keras_serializable). "
                f"Received class {record['registered_name']!r}"
            )
        children = [
            (child["attributes"], self.revive(child["id"])) for child in record["sublayers"]
        ]
        child_vars: set[int] = set()
        for child in record["sublayers"]:
            child_vars.update(self.records[child["id"]]["variables"])
        own_ids = [i for i in record["variables"] if i not in child_vars]
        seed_ids = [i for i in own_ids if self.var_records[i].get("seed_state")]
        own_ids = [i for i in own_ids if i not in seed_ids]
        own = [self._keras_variable(i) for i in own_ids]
        dtype = _policy(record["dtype_policy"])
        restored_loops.prepare(node)
        layer = standins.make_revived(record, node, children, own, dtype)
        seeds = [(self.var_records[i], self.storage[i]) for i in seed_ids]
        standins.attach_seed_generators(layer, seeds)
        rnn_states.expose(layer, record, node, self.where)
        for index, variable in zip(own_ids, own, strict=True):
            # Created as their kind (so that a frozen layer's weights are trainable again
            # once it is unfrozen: Keras flips only those it created trainable), then given
            # the flag they had when saved.
            variable.trainable = self.var_records[index]["trainable"]
        self._attach_regularizers(node, own_ids, own)
        constraints.restore(
            [(self.var_records[i], v) for i, v in zip(own_ids, own, strict=True)],
            layer=record["name"],
            custom_objects=self.custom_objects,
            safe_mode=self.safe_mode,
            where=self.where,
        )
        self.how[record["name"]] = "traced"
        return layer

    # ---------------------------------------------------------------------- storage
    def _keras_variable(self, index: int) -> keras.Variable:
        if index not in self.keras_vars:
            rec = self.var_records[index]
            self.keras_vars[index] = keras_compat.variable_over_storage(
                self.storage[index],
                name=rec.get("name") or f"variable_{index}",
                trainable=_trainable_kind(rec),
                path=rec.get("path"),
            )
        return self.keras_vars[index]

    def _attach_regularizers(self, node: Any, own_ids: list[int], own: list[Any]) -> None:
        functions = list(getattr(node, "regularizer_functions", []) or [])
        with_reg = [
            v
            for i, v in zip(own_ids, own, strict=True)
            if self.var_records[i]["has_regularizer"] and _trainable_kind(self.var_records[i])
        ]
        for variable, function in zip(with_reg, functions, strict=False):
            variable.regularizer = standins.TracedRegularizer(function)

    def bind(self, layer: keras.layers.Layer, record: dict[str, Any], *, strict: bool) -> bool:
        """Point every Keras variable of ``layer`` at the loaded storage: by name within
        the layer where the names tell (``records.rebuilt_order``), else by position."""
        variables = list(layer.variables)
        saved = record["variables"]
        order = rebuilt_order(
            [(v.name, v.path) for v in variables],
            [(self.var_records[i].get("name"), self.var_records[i].get("path")) for i in saved],
        )
        if order is not None:
            saved = [saved[i] for i in order]
        problem = None
        if len(variables) != len(saved):
            problem = f"{len(variables)} variables rebuilt, {len(saved)} saved"
        else:
            for variable, index in zip(variables, saved, strict=True):
                storage = self.storage[index]
                if tuple(variable.shape) != tuple(storage.shape) or (
                    tf.as_dtype(variable.dtype) != storage.dtype
                ):
                    problem = f"{variable.path} {tuple(variable.shape)} vs {tuple(storage.shape)}"
                    break
        if problem is not None:
            if strict:
                raise CorruptCheckpointError(
                    f"{self.where}: layer {record['name']!r} rebuilt with variables that do "
                    f"not match the saved ones ({problem}). The checkpoint is damaged or its "
                    f"classes changed since it was saved."
                )
            return False
        for variable, index in zip(variables, saved, strict=True):
            bound = self.keras_vars.setdefault(index, variable)
            if not isinstance(self.storage[index], Stored):
                keras_compat.set_variable_storage(variable, self.storage[index])
            elif bound is not variable:  # two rebuilt variables, one saved storage
                self._require_functions(record, "shares a variable with another layer")
            self._restore_path(variable, index)
        return True

    def _restore_path(self, variable: keras.Variable, index: int) -> None:
        """The saved path back on a variable rebuilt from config: a sublayer Keras builds
        while deserializing its parent (a wrapper's layer, a ``Bidirectional``'s forward and
        backward layers, an RNN's cell) loses every prefix above it otherwise, and what is
        keyed by path (a user's ``{v.path: v}``, the optimizer slot names Keras derives from
        it) would change with the load."""
        saved = self.var_records[index].get("path")
        if isinstance(saved, str) and saved and saved != variable.path:
            keras_compat.restore_variable_path(variable, saved)

    def _bind_states(self, layer: keras.layers.Layer, record: dict[str, Any]) -> None:
        """A stateful RNN rebuilt from its class keeps the loaded states that the traced
        functions of its revived parents use (``rnn_states``), not states of its own."""
        rnn_states.bind(layer, record, self.nodes[record["id"]], self.where)

    def assign_stored(self, read: Any) -> None:
        """Give every variable bound to a stored (not loaded) entry its stored value
        (``read(storage entry)`` returns the array)."""
        for index, variable in self.keras_vars.items():
            if isinstance(self.storage[index], Stored):
                variable.assign(read(self.storage[index]))

    def _adopt_children(self, layer: keras.layers.Layer, record: dict[str, Any]) -> None:
        """Children rebuilt by the parent's config count as revived (shared identity).
        Their stateful RNNs keep the loaded states even when a record was revived apart
        first (the substituted config is prepared before the plain one is tried)."""
        kids = keras_compat.tracked_sublayers(layer)
        saved = record["sublayers"]
        if len(kids) != len(saved):
            return
        for kid, child in zip(kids, saved, strict=True):
            child_record = self.records[child["id"]]
            if type(kid).__name__ != child_record["class_name"]:
                continue
            if self.layers.get(child["id"]) is kid:
                continue  # revived as it is: its subtree was handled then
            self.layers.setdefault(child["id"], kid)
            self._bind_states(kid, child_record)
            self._adopt_children(kid, child_record)


def _is_graph_config(record: dict[str, Any]) -> bool:
    """Whether Keras rebuilds this layer as a graph around its revived layers (see
    ``records.is_graph_config``, which the save consults too)."""
    return is_graph_config(record["model_kind"], record["keras_config"])


def _policy(config: Any) -> Any:
    try:
        return keras.dtype_policies.deserialize(config)
    except (ValueError, TypeError, LookupError, AttributeError):  # untrusted record
        return config if isinstance(config, str) else None


def _trainable_kind(record: dict[str, Any]) -> bool:
    """Whether the variable was created trainable (records written before this was kept:
    its flag when saved)."""
    kind = record.get("trainable_kind")
    return kind if isinstance(kind, bool) else bool(record["trainable"])
