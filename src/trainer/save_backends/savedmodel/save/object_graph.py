"""Assemble the object graph of a model: root module, one node per layer, records.

The result (``TracedModel``) is what the trace cache keeps between saves: as long as the
model's structure fingerprint is unchanged, the same root can be checkpointed again
without tracing anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.errors import ModelNotReadyError
from trainer.model_state import kit, readiness
from trainer.save_backends.savedmodel import records
from trainer.save_backends.savedmodel.features import python_gradients, rnn_states, training_logic
from trainer.save_backends.savedmodel.features.keras_objects import tf_variable
from trainer.save_backends.savedmodel.save import (
    config_rebuilt,
    endpoints,
    options,
    served_inputs,
    state_variables,
    structure,
    tracing,
)
from trainer.save_backends.savedmodel.save.tracing import Node


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


def optimizer_variables(model: keras.Model) -> list[Any]:
    """The optimizer's variables, built if need be; none in an ``inference_only`` save."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not kit.saving_optimizer():
        return []
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return list(optimizer.variables)


def _spec_summary(spec: tuple[Any, Any]) -> str:
    return repr(spec)[:500]


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
    functions, call_specs, python_gradient = _trace_layer(
        layer,
        node,
        recorder.specs[id(layer)],
        dispatcher,
        calls=calls,
        training=training,
        unresolved=unresolved,
    )
    functions.update(_trace_compute_mask(layer, node, recorder.mask_specs[id(layer)]))
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


def _trace_compute_mask(layer: keras.layers.Layer, node: Node, specs: dict[str, Any]):
    """A traced ``compute_mask`` for a layer that overrides it, for every (input, mask)
    pair it was called with and for the same input without a mask: a layer revived from
    traces then hands downstream layers the masks the original would."""
    if not specs or not tracing.has_own_compute_mask(layer):
        return {}
    fn = tracing.make_compute_mask_function(layer)
    try:
        for inputs, mask in specs.values():
            for variant in (mask, tf.nest.map_structure(lambda _: None, mask)):
                fn.get_concrete_function(_named(inputs, "inputs"), _named(variant, "mask"))
    except Exception as err:
        raise ModelNotReadyError(
            f"Layer {layer.name!r} ({type(layer).__name__}): its compute_mask could not be "
            f"traced: {type(err).__name__}: {err}. It must run inside a tf.function on the "
            f"inputs and mask its call receives. Received layer {layer.name!r}"
        ) from err
    node.compute_mask = fn
    return {"compute_mask": "compute_mask"}


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


def variable_record_for(variable: Any, index: int, owner: int | None) -> dict[str, Any]:
    return records.variable_record(variable, index, owner)


def _fallback_specs(layer: keras.layers.Layer) -> dict[str, Any]:
    """Specs for a layer the serving trace never called: children of a revived parent
    (whose traced function calls them inside), or layers used only in training."""
    revived_fn = live_objects.get_marker(layer, live_objects.TRACED_INFERENCE_CALL)
    found: dict[str, Any] = {}
    if revived_fn is not None:
        for concrete in tf_compat.concrete_functions(revived_fn):
            args = concrete.structured_input_signature[0]
            if len(args) == 2:
                found[repr(args)] = (tuple(args[0]), dict(args[1]))
        return found
    shapes = keras_compat.build_shapes(layer)
    if len(shapes) == 1:
        shape = list(next(iter(shapes.values())))
        if shape and all(isinstance(d, int | type(None)) for d in shape):
            spec = tf.TensorSpec([None, *shape[1:]], layer.input_dtype)
            found["build"] = ((spec,), {})
    return found


def _named(structure: Any, prefix: str) -> Any:
    """Name specs the way tf.function names them in ``structured_input_signature``:
    tf.saved_model.save looks functions up again by that signature, and a spec whose name
    differs is a cache miss that silently traces the whole layer a second time."""

    def name(path: tuple, spec: Any) -> Any:
        if not isinstance(spec, tf.TensorSpec):
            return spec
        return tf.TensorSpec(spec.shape, spec.dtype, name="_".join([prefix, *map(str, path)]))

    return tf_compat.map_structure_with_tuple_paths(name, structure)


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


def _trace_layer(
    layer: keras.layers.Layer,
    node: Node,
    specs: dict[str, Any],
    dispatcher: Any = None,
    *,
    calls: bool = True,
    training: bool = True,
    unresolved: bool = False,
):
    """Concrete call functions for each recorded call spec, for both training values
    (none unless ``calls``; inference only unless ``training``), and with ``training``
    unresolved if ``unresolved`` (``call_default``)."""
    functions: dict[str, Any] = {}
    first_traced: dict[str, Any] = {}  # attribute -> its first concrete function
    python_gradient = False
    specs = (specs or _fallback_specs(layer)) if calls else {}
    summaries = [_spec_summary(s) for s in specs.values()]
    try:
        if specs:
            modes = {"call_infer": False, "call_train": True}
            if not tracing.training_matters(layer):
                modes = {"call_infer": None}
            elif not training:
                modes = {"call_infer": False}
            if unresolved and "call_infer" in modes and modes["call_infer"] is False:
                modes["call_default"] = None
            for attr, training in modes.items():
                fn = tracing.make_call_function(
                    layer, training, dispatcher, unresolved=attr == "call_default"
                )
                for args, kwargs in specs.values():
                    concrete = fn.get_concrete_function(
                        _named(args, "args"), _named(kwargs, "kwargs")
                    )
                    first_traced.setdefault(attr, concrete)
                    python_gradient = python_gradient or python_gradients.used(concrete)
                setattr(node, attr, fn)
                functions[attr] = f"{attr}"
        regs = []
        reg_vars = []
        for v in keras_compat.own_trainable_variables(layer):
            if getattr(v, "regularizer", None) is not None:
                regs.append(tracing.make_regularizer_function(v))
                reg_vars.append(id(tf_variable(v)))
        if regs:
            node.regularizer_functions = regs
            functions["regularizer_functions"] = len(regs)
        if getattr(layer, "activity_regularizer", None) is not None and "call_infer" in functions:
            concrete = first_traced["call_infer"]
            out = tf.nest.flatten(concrete.structured_outputs[0])[0]
            spec = tf.TensorSpec(out.shape, out.dtype)
            node.activity_regularizer_function = tracing.make_activity_function(layer, spec)
            functions["activity_regularizer_function"] = "activity_regularizer_function"
    except Exception as err:
        raise ModelNotReadyError(
            f"Layer {layer.name!r} ({type(layer).__name__}) could not be traced: "
            f"{type(err).__name__}: {err}. Its call must run inside a tf.function. "
            f"Received layer {layer.name!r}"
        ) from err
    return functions, summaries, python_gradient
