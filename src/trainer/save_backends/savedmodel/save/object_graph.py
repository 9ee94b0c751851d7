"""Assemble the object graph of a model: root module, one node per layer, records.

The result (``TracedModel``) is what the trace cache keeps between saves: as long as the
model's structure fingerprint is unchanged, the same root can be checkpointed again
without tracing anything. Which variables it holds is planned before (``variable_plan``)
and each layer's functions are traced by ``layer_functions``; here they become one node
per layer under the root, with the serving endpoints and the records a load reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import tensorflow as tf_compat
from trainer.model_state import kit, readiness
from trainer.save_backends.savedmodel import records
from trainer.save_backends.savedmodel.features import python_gradients, rnn_states, training_logic
from trainer.save_backends.savedmodel.features.keras_objects import tf_variable
from trainer.save_backends.savedmodel.save import (
    config_rebuilt,
    endpoints,
    layer_functions,
    options,
    served_inputs,
    structure,
    tracing,
)
from trainer.save_backends.savedmodel.save.tracing import Node

# Moved to ``variable_plan``, still importable from here (and from the pre-0.2 path
# ``trainer.save_backends.savedmodel.object_graph``, which ``trainer._moved`` points here).
from trainer.save_backends.savedmodel.save.variable_plan import (
    VariablePlan as VariablePlan,
)
from trainer.save_backends.savedmodel.save.variable_plan import (
    optimizer_variables as optimizer_variables,
)
from trainer.save_backends.savedmodel.save.variable_plan import (
    plan_variables as plan_variables,
)
from trainer.save_backends.savedmodel.save.variable_plan import (
    variable_record_for as variable_record_for,
)


@dataclasses.dataclass
class TracedModel:
    root: tf.Module
    serving: Any  # concrete serving function
    layers: list[dict[str, Any]]
    variables: list[dict[str, Any]]
    optimizer_variables: list[dict[str, Any]]
    signature: dict[str, Any]
    fingerprint: str
    # The metadata's "savedmodel" entry as JSON: the same for every save of this trace,
    # so encoded once (on a large model, re-encoding it was a tenth of a repeat save).
    encoded: str | None = None


def trace_model(model: keras.Model, plan: VariablePlan) -> TracedModel:
    """Trace every layer's call functions once and build the root ``tf.Module`` holding
    the variables of ``plan`` (``plan_variables``)."""
    layers, layer_index, opt_vars = plan.layers, plan.layer_index, plan.optimizer
    tf_vars, var_records = plan.storages, plan.records
    args = endpoints.model_call_args(model)
    recorder = tracing.CallRecorder(layers)
    args = served_inputs.record_served_specs(model, recorder, args)
    # Every layer's config once, before any tracing mutes a regularizer: the records and
    # the check below read the same one.
    configs = [records.keras_config(layer) for layer in layers]
    # No call functions for layers a load only ever rebuilds from their class: those
    # whose __call__ replays in a Sequential, and Keras' own layers that rebuild from
    # their config (``config_rebuilt``; their parents' traces hold their ops inline).
    recorder.class_only = readiness.replayed_by_sequential(model)
    recorder.class_only |= config_rebuilt.layers_rebuilt_from_config(layers, configs)
    nodes: list[Node | None] = [None] * len(layers)
    layer_records: list[dict[str, Any] | None] = [None] * len(layers)
    # Traced inside the same save context tf.saved_model.save uses: the context is part of
    # tf.function's cache key, and outside it the save would trace every function again.
    with tf_compat.saving_context(options.SAVE_OPTIONS), tracing.Dispatcher() as dispatcher:
        for li in _children_first(layers, layer_index):
            nodes[li], layer_records[li] = _trace_node(
                layers[li], li, configs[li], plan, recorder, dispatcher
            )
        # serve calls the model's traced function, serving_default calls serve: the
        # model's ops are stored once, under the root layer's call_infer.
        named, specs, composite = endpoints.named_args(args, model)
        serve = endpoints.make_serve(model, named)
        serving_default = endpoints.make_serving_default(model, serve, named, specs)
        serving = serving_default.get_concrete_function()
    python_gradients.propagate(layer_records)  # a parent's traces call its children's
    for li, layer in enumerate(layers):
        tracked = keras_compat.tracked_sublayers(layer)
        children = [nodes[layer_index[id(c)]] for c in tracked if id(c) in layer_index]
        if children:
            nodes[li].sublayers = children
    root = Node(name="trainer_savedmodel")
    # Keras's export endpoint: the model's own positional inputs and output structure.
    root.serve = serve
    # Also an attribute: TFSMLayer prefers attributes, which accept a dict positionally.
    root.serving_default = serving_default
    root.model_variables = tf_vars
    root.optimizer_variables = [tf_variable(v) for v in opt_vars]
    root.layer_nodes = nodes
    return TracedModel(
        root=root,
        serving=serving,
        layers=layer_records,
        variables=var_records,
        optimizer_variables=[
            {"index": i, "path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
            for i, v in enumerate(opt_vars)
        ],
        signature=_signature(specs, serving, args, composite),
        fingerprint=structure.fingerprint(model),
    )


def _trace_node(
    layer: keras.layers.Layer,
    li: int,
    serialized: tuple[dict[str, Any] | None, str | None],
    plan: VariablePlan,
    recorder: tracing.CallRecorder,
    dispatcher: tracing.Dispatcher,
) -> tuple[Node, dict[str, Any]]:
    """One layer's node (its variables, resources and traced functions) and record;
    ``serialized``: ``records.keras_config(layer)``."""
    layer_index, var_index, var_records = plan.layer_index, plan.index, plan.records
    node = Node(name=f"layer_{li}")
    node.layer_variables = [tf_variable(v) for v in layer.variables]
    if plan.resources[li]:
        node.resources = plan.resources[li]
    if plan.state[li]:  # read or updated by its traced calls: the graph must reach them
        node.state_variables = plan.state[li]  # the lists ``plan.checkpointed`` holds
    calls = id(layer) not in recorder.class_only
    # Nothing calls the root in training mode but its own revival, and a root revived as
    # a graph (Functional, Sequential) is rebuilt from its config around its layers: its
    # training trace (every variable captured again) would never run.
    # Unless its class computes otherwise (overrides ``call``): missing at load, such a
    # subclass revives from its traces (graph_revival), training included.
    graph = records.is_graph_config(records.model_kind(layer), serialized[0])
    training = li != 0 or not graph or bool(training_logic.computation_overridden(layer))
    # A serving export (saved without the optimizer) is for inference: no training traces,
    # which were a third of an export's time. A layer revived from it without its class
    # refuses ``training=True`` (``training_traced`` below); its class trains as usual.
    # A call leaving ``training`` unresolved runs this trace (a serving export's too:
    # ``model(x)`` and ``predict`` on such a model train the layers defaulting to it).
    unresolved = training and calls and tracing.unresolved_training_matters(layer)
    training = training and kit.saving_optimizer()
    functions, call_specs, python_gradient = layer_functions.trace_layer(
        layer,
        node,
        recorder.specs[id(layer)],
        dispatcher,
        calls=calls,
        training=training,
        unresolved=unresolved,
    )
    mask_specs = recorder.mask_specs[id(layer)]
    functions.update(layer_functions.trace_compute_mask(layer, node, mask_specs))
    own = [var_index[id(tf_variable(v))] for v in layer.variables]
    own = [i for i in own if var_records[i]["owner"] == li]
    record = records.layer_record(
        layer,
        li,
        layer_index=layer_index,
        variable_index=var_index,
        own_variables=own,
        functions=functions,
        call_specs=call_specs,
        serialized=serialized,
    )
    if "call_infer" in functions and not training and tracing.training_matters(layer):
        record["training_traced"] = False  # its training behaviour is not in this save
    if python_gradient:
        record[python_gradients.RECORD_KEY] = True
    rnn_states.record(layer, plan.state[li], record)  # which node state_variables they are
    # After the record: this mutes its regularizer. A layer overriding __call__ is not
    # dispatched: its traced function holds its __call__ Python, which the parent's call
    # runs too before reaching ``call`` (the override would be applied twice). Nor is an
    # RNN cell reading the dropout masks its RNN drew (``uses_parent_dropout_masks``).
    dispatched = not readiness.overrides_call(layer)
    dispatched = dispatched and not tracing.uses_parent_dropout_masks(layer)
    if hasattr(node, "call_infer") and dispatched:
        default = getattr(node, "call_default", None)
        dispatcher.add(layer, node.call_infer, getattr(node, "call_train", None), default)
    return node, record


def _signature(
    specs: list[tf.TensorSpec],
    serving: Any,
    args: tuple[Any, ...],
    composite: list[dict[str, Any]],
) -> dict[str, Any]:
    """The serving signature as recorded in the metadata; ``structure`` is the single
    argument's structure, or the list of the positional arguments' (``positional_args``);
    ``composite_inputs`` (only if any) which ragged or sparse input each group of the
    signature's inputs makes up."""
    structure = args[0] if len(args) == 1 else list(args)
    extra = {"composite_inputs": composite} if composite else {}
    return {
        **extra,
        "inputs": [
            {"name": s.name, "shape": s.shape.as_list(), "dtype": s.dtype.name} for s in specs
        ],
        "outputs": sorted(serving.structured_outputs),
        "structure": tf.nest.map_structure(lambda s: None, structure),
        "structure_is_dict": isinstance(structure, dict),
        "positional_args": len(args),
    }


def _children_first(layers: list[keras.layers.Layer], index: dict[int, int]) -> list[int]:
    """Post-order over the layer DAG, so every child is traced before its parents."""
    order: list[int] = []
    seen: set[int] = set()

    def visit(i: int) -> None:
        if i in seen:
            return
        seen.add(i)
        for child in keras_compat.tracked_sublayers(layers[i]):
            if id(child) in index:
                visit(index[id(child)])
        order.append(i)

    for i in range(len(layers)):
        visit(i)
    return order
