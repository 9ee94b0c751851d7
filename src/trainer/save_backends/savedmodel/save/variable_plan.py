"""Which variables a save stores, and in which order: known from the model alone, before
any tracing.

Split from ``object_graph`` because the plan is needed first and on its own: the
variables are written while the functions are traced (``variables_first`` starts from
the plan), and whether trainer's own SaverDef can be written (plain variables only) is
known from it before the first ``tf.saved_model.save``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer.model_state import kit
from trainer.save_backends.savedmodel import records
from trainer.save_backends.savedmodel.features.keras_objects import tf_variable
from trainer.save_backends.savedmodel.save import state_variables, tracing


def optimizer_variables(model: keras.Model) -> list[Any]:
    """The optimizer's variables, built if need be; none in an ``inference_only`` save."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not kit.saving_optimizer():
        return []
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return list(optimizer.variables)


@dataclasses.dataclass
class VariablePlan:
    """Which variables a save stores, and in which order: known before any tracing, so
    the variables can be written while the functions are traced (``variables_first``)."""

    layers: list[keras.layers.Layer]
    layer_index: dict[int, int]
    optimizer: list[Any]  # the optimizer's Keras variables
    storages: list[tf.Variable]  # the root's model_variables, in order
    records: list[dict[str, Any]]
    index: dict[int, int]  # id(storage) -> position in ``storages``
    # Per layer: variables its calls use beyond its weights (``state_variables``), and the
    # TF resources it holds (lookup tables): its node's ``state_variables``/``resources``.
    state: list[list[tf.Variable]]
    resources: list[list[Any]]

    def plain_variables_only(self) -> bool:
        """Whether the checkpoint holds only plain variables, as trainer's own SaverDef and
        ``variables_first`` need: no distributed variable (saved through its strategy's
        saveables) and no layer resource (a table may have checkpoint entries of its own)."""
        if any(self.resources):
            return False
        optimizer = [tf_variable(v) for v in self.optimizer]
        variables = [*self.storages, *optimizer, *(v for s in self.state for v in s)]
        return not any(
            isinstance(v, tf.distribute.DistributedValues) or not isinstance(v, tf.Variable)
            for v in variables
        )

    def checkpointed(self) -> tf.Module:
        """A module holding every variable the SavedModel's root holds, by the same paths
        from the root: ``model_variables``, ``optimizer_variables`` and each layer node's
        ``state_variables``. Its checkpoint restores into the root as the root's own."""
        holder = tf.Module()
        holder.model_variables = list(self.storages)
        holder.optimizer_variables = [tf_variable(v) for v in self.optimizer]
        holder.layer_nodes = [tf.Module() for _ in self.layers]
        for node, extra in zip(holder.layer_nodes, self.state, strict=True):
            if extra:
                node.state_variables = extra
        return holder


def plan_variables(model: keras.Model) -> VariablePlan:
    layers = tracing.all_layers(model)
    opt_vars = optimizer_variables(model)  # build it now, its slots belong in variables/
    tf_vars, var_records, var_index = _variable_table(layers)
    layer_index = {id(layer): i for i, layer in enumerate(layers)}
    state = [state_variables.state_variables(layer) for layer in layers]
    resources = [tracing.trackable_resources(layer) for layer in layers]
    return VariablePlan(
        layers, layer_index, opt_vars, tf_vars, var_records, var_index, state, resources
    )


def _variable_table(
    layers: list[keras.layers.Layer],
) -> tuple[list[tf.Variable], list[dict[str, Any]], dict[int, int]]:
    """Every variable's storage once, parents first, each owned by the layer whose own
    variable it is; returns the storages, their records and storage id -> index."""
    tf_vars: list[tf.Variable] = []
    var_records: list[dict[str, Any]] = []
    var_index: dict[int, int] = {}
    owners: dict[int, int] = {}
    trainable_kind: set[int] = set()  # created trainable, whatever the flag is now
    seed_kind: set[int] = set()  # a SeedGenerator's state: a variable, not a weight
    for li, layer in enumerate(layers):
        for v in keras_compat.own_variables(layer):
            owners.setdefault(id(tf_variable(v)), li)
        created_trainable = keras_compat.own_trainable_variables(layer)
        trainable_kind.update(id(tf_variable(v)) for v in created_trainable)
        seed_kind.update(id(tf_variable(v)) for v in keras_compat.seed_generator_states(layer))
    for layer in layers:
        for v in layer.variables:
            storage = tf_variable(v)
            if id(storage) in var_index:
                continue
            var_index[id(storage)] = len(tf_vars)
            record = variable_record_for(v, len(tf_vars), owners.get(id(storage)))
            record["trainable_kind"] = id(storage) in trainable_kind
            record["seed_state"] = id(storage) in seed_kind
            var_records.append(record)
            tf_vars.append(storage)
    return tf_vars, var_records, var_index


def variable_record_for(variable: Any, index: int, owner: int | None) -> dict[str, Any]:
    return records.variable_record(variable, index, owner)
