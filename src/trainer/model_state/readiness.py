"""What makes a built model savable beyond its own ``built`` flag.

Unbuilt sublayers. A layer that keeps Keras' default ``build`` creates no weights when
built, so it is ready even unbuilt: a parent may run its ``call`` directly and never mark
it built (``TextVectorization`` does so with its inner ``StringLookup``, whose state, the
vocabulary, exists from ``adapt`` on).

Layers whose class overrides ``__call__`` (runs Python before ``super().__call__``). Such
a layer works in every backend as long as its model is rebuilt by calling the layer once
per call, as a subclassed model's ``call`` does. A graph model is different when the
override changes the inputs: building the graph ran that code on symbolic tensors and
recorded its operations, then the layer's call on the changed inputs, and running the
graph calls the layer again (the override applies twice).

- A Functional model keeps those operations in its config, and rebuilding it from the
  config runs the override once more on top: the loaded model would compute something else
  (Keras' own ``.keras`` format does so silently). trainer refuses to save it.
- A Sequential model keeps only its layers and is rebuilt by the same construction, so a
  class rebuilt from config is faithful; but a layer revived from traced functions cannot
  replay the operations construction recorded, so such a layer gets no traced functions
  and a load without its class says the class is needed.

A subclassed model without its own ``build``. Keras builds it by calling it on symbolic
inputs, which cannot create variables from values (a stateful RNN's states): its first
eager call then builds its layers but records no build config (``get_build_config()`` is
None although ``built`` is True), and a rebuild from its config and build config is left
without those states. Every load of such a model would fail (savedmodel needs the input
shape to trace it; h5 and weights rebuild it from its config), so it is refused at save
time (``unrecorded_build_error``, ``refuse_unbuildable_rebuild``).

Layers revived from traced functions (their class was missing when they were loaded, or
a legacy ``Lambda``). Only a backend that keeps their traces (savedmodel) can store them:
a backend storing configs and weights would write a config naming trainer's stand-in of
the class, not the class itself, so the checkpoint could not be loaded back in the process
that wrote it, and with the class at hand a legacy stand-in's weights (its sublayers'
flattened onto it) would not fit the class. Such saves are refused up front.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import keras

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer.errors import ModelNotReadyError
from trainer.model_state import layer_protocol


def unbuilt_layers(model: keras.Model) -> list[str]:
    """Names of the sublayers (every depth) whose weights do not exist yet."""
    seen: dict[int, keras.layers.Layer] = {}
    stack = keras_compat.sublayers(model)
    while stack:
        layer = stack.pop()
        if id(layer) not in seen:
            seen[id(layer)] = layer
            stack.extend(keras_compat.sublayers(layer))
    return [
        layer.name
        for layer in seen.values()
        if not layer.built and type(layer).build is not keras.layers.Layer.build
    ]


def overrides_call(layer: keras.layers.Layer) -> bool:
    """Whether the layer's class (not Keras) defines ``__call__``."""
    for cls in type(layer).__mro__:
        if "__call__" in vars(cls):
            return not cls.__module__.startswith("keras.")
    return False


def refuse_reapplied_overrides(model: keras.Model) -> None:
    """Refuse a Functional model holding a layer whose ``__call__`` changes its inputs."""
    every = keras_compat.sublayers(model, include_self=True, recursive=True)
    for graph in [m for m in every if keras_compat.is_functional(m)]:
        for layer in _input_changing(graph):
            raise ModelNotReadyError(
                f"Layer {layer.name!r} ({type(layer).__name__}) of Functional model "
                f"{graph.name!r} overrides __call__ and changes its inputs before Keras' own "
                f"__call__. The saved graph already holds the changed inputs, and rebuilding "
                f"the model from its config runs that code again, so the loaded model would "
                f"compute something else (Keras' .keras format does so silently). Move that "
                f"code into the layer's call(), or use a Sequential or subclassed model, "
                f"then save. Received: "
                f"{type(layer).__module__}.{type(layer).__qualname__}.__call__"
            )


def replayed_by_sequential(model: keras.Model) -> set[int]:
    """Ids of the layers of (nested) Sequential models whose ``__call__`` changes their
    inputs: rebuilt faithfully only from their class (see the module's docstring)."""
    every = keras_compat.sublayers(model, include_self=True, recursive=True)
    # ``inputs`` raises AttributeError for a Sequential whose layers Keras could not link
    # into a graph: it runs them one by one, like a subclassed model.
    linked = [m for m in every if isinstance(m, keras.Sequential) and hasattr(m, "inputs")]
    return {id(layer) for graph in linked for layer in _input_changing(graph)}


def _input_changing(graph: keras.Model) -> list[keras.layers.Layer]:
    return [layer for layer in graph.layers if overrides_call(layer) and changes_inputs(layer)]


class _Reached(Exception):
    """Raised in place of the layer's computation once its inputs are known."""


def changes_inputs(layer: keras.layers.Layer) -> bool:
    """Call the layer on its own graph inputs and see whether what reaches Keras' part of
    ``__call__`` is still those inputs (Keras may cast floats to the layer's dtype). The
    layer's computation is not run: the call stops where it would start."""
    try:
        graph_input = layer.input
    except (AttributeError, ValueError):  # never called in a graph: nothing to rebuild
        return False
    # Fresh symbolic tensors, produced by no operation: the probe leaves the graph as is.
    given = keras.tree.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype), graph_input)
    reached: dict[str, Any] = {}

    def stop(*args: Any, **kwargs: Any) -> Any:
        reached["inputs"] = args[0] if args else None
        raise _Reached

    restore = live_objects.patch_method(layer, "symbolic_call", stop)
    try:
        layer(given)
    except _Reached:
        pass
    except Exception:  # the layer takes more than its first input: cannot tell
        return False
    finally:
        restore()
    flat_given = keras.tree.flatten(given)
    flat_reached = keras.tree.flatten(reached.get("inputs"))
    if len(flat_given) != len(flat_reached):
        return True
    return not all(
        a is b or _cast_by_keras(layer, a, b) for a, b in zip(flat_given, flat_reached, strict=True)
    )


def _cast_by_keras(layer: keras.layers.Layer, given: Any, reached: Any) -> bool:
    return (
        tuple(getattr(given, "shape", ())) == tuple(getattr(reached, "shape", ()))
        and getattr(reached, "dtype", None) == layer.input_dtype
        and getattr(given, "dtype", None) != layer.input_dtype
    )


def revived_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model and its sublayers (every depth) that stand in for a class from traced
    functions: they say where they were revived from (``live_objects.REVIVED_FROM``)."""
    every = keras_compat.sublayers(model, include_self=True, recursive=True)
    return [layer for layer in every if live_objects.get_marker(layer, live_objects.REVIVED_FROM)]


def refuse_revived_layers(model: keras.Model, backend: str) -> None:
    """Refuse a model holding layers revived from traced functions, for a backend that
    stores configs and weights only (see the module's docstring)."""
    revived = revived_layers(model)
    if not revived:
        return
    first = revived[0]
    name = type(first).__name__
    original = live_objects.get_marker(first, live_objects.ORIGINAL_IDENTITY) or {}
    if name == "LegacyLambda" or original.get("carries_code"):
        why = "its stored Python code was not run (a Lambda)"
        remedy = "Only the savedmodel backend can store it: save with backend 'savedmodel'."
    else:
        why = "its class was not available when it was loaded"
        remedy = (
            f"Save with the savedmodel backend (it keeps the traced functions), or load "
            f"the model again with the class available (custom_objects={{{name!r}: cls}}) "
            f"and save that model with {backend!r}."
        )
    source = live_objects.get_marker(first, live_objects.REVIVED_FROM)
    raise ModelNotReadyError(
        f"Layer {first.name!r} ({name}) of model {model.name!r} was revived from the "
        f"traced functions of {source} ({why}). The {backend!r} "
        f"backend stores configs and weights only: its checkpoint would name a stand-in "
        f"instead of the class and could not be loaded back faithfully. {remedy} "
        f"Received: layers revived from traces {[layer.name for layer in revived]}"
    )


def check_model_ready(model: Any) -> None:
    """Refuse to save what cannot be saved faithfully, before anything is written."""
    if not isinstance(model, keras.Model):
        raise ModelNotReadyError(
            f"Only Keras 3 models can be saved; wrap layers in a keras.Model first. "
            f"Received an object of type {type(model).__module__}.{type(model).__name__}"
        )
    unbuilt = unbuilt_layers(model)
    if not model.built or unbuilt:
        names = ", ".join(unbuilt[:5]) or model.name
        raise ModelNotReadyError(
            f"Model {model.name!r} is not built (unbuilt layers: {names}), so its weights do "
            f"not exist yet. Call the model on a batch of data, call model.build(input_shape), "
            f"or train it before saving. Received model {model.name!r} "
            f"({type(model).__name__})"
        )


def refuse_unrecorded_policies(model: keras.Model) -> None:
    """Refuse a layer whose config records a dtype other than the policy it runs under.

    Keras's ``Discretization``, ``HashedCrossing`` and ``SpatialDropout*`` write their
    variable dtype (``"float32"``) into ``get_config()`` where other layers write their
    policy: under ``mixed_bfloat16`` such a layer bins (or drops) its bf16-rounded inputs
    in ``fit`` and ``predict``, but every load, Keras's ``.keras`` too, rebuilds it under
    ``float32``: other outputs, silently (Keras 3.15.1)."""
    for layer in keras_compat.sublayers(model):
        if isinstance(layer, keras.Model | keras.layers.InputLayer):
            continue  # a nested model's layers are visited themselves; inputs carry no policy
        try:
            recorded = layer.get_config().get("dtype")
        except Exception:  # a layer without a config: the backends say so themselves
            continue
        policy = getattr(layer, "dtype_policy", None)
        if isinstance(recorded, str) and policy is not None and recorded != policy.name:
            raise ModelNotReadyError(
                f"Layer {layer.name!r} ({type(layer).__name__}) runs under dtype policy "
                f"{policy.name!r}, but its get_config() records dtype {recorded!r} (a Keras "
                f"bug in this class), so every load would rebuild it under {recorded!r} and "
                f"compute other outputs. Construct it with an explicit dtype (for example "
                f"dtype={recorded!r}), so that it runs as it will be rebuilt. "
                f"Received policy {policy.name!r} vs config dtype {recorded!r}"
            )


# ------------------------------------------------- subclassed models Keras builds symbolically
_REBUILD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _built_symbolically(model: keras.Model) -> bool:
    """A subclassed model without its own ``build``: Keras builds it, when rebuilt from its
    config, by calling it on symbolic inputs."""
    return (
        not keras_compat.is_functional(model)
        and not isinstance(model, keras.Sequential)
        and type(model).build is keras.layers.Layer.build
    )


def _rnn_state_count(model: keras.Model) -> int:
    return sum(
        len(layer_protocol.rnn_states(layer)) for layer in layer_protocol.stateful_layers(model)
    )


def unrecorded_build_error(model: keras.Model, backend: str) -> ModelNotReadyError | None:
    """The error for a built subclassed model that recorded no build config (see the
    module's docstring), or None if it is not one."""
    if not (model.built and _built_symbolically(model)) or model.get_build_config():
        return None
    name = type(model).__name__
    return ModelNotReadyError(
        f"Model {model.name!r} ({name}) is built, but Keras recorded no input shape for it "
        f"(its get_build_config() is None): {name} has no build() of its own, Keras could not "
        f"build it by a symbolic call (a stateful RNN, for one, creates its states only when "
        f"called eagerly), so its first call built its layers without recording the shape. "
        f"The {backend!r} backend needs that shape to save a model that loads (to trace it, "
        f"or to rebuild it from its config). Define build(self, input_shape) on {name} "
        f"building its layers (for example self.lstm.build(input_shape)), create the model "
        f"again and call it on a batch before saving. Received: {name}, built=True, "
        f"get_build_config()=None"
    )


def refuse_unbuildable_rebuild(model: keras.Model, backend: str) -> None:
    """For a backend that rebuilds the model from its config and build config (h5,
    weights): refuse a subclassed model without its own ``build`` whose rebuild would lack
    weights or stateful RNN states, found by rebuilding a dropped copy (only for a model
    without a build config or holding a stateful RNN; once per model and set of layers)."""
    error = unrecorded_build_error(model, backend)
    states = _rnn_state_count(model) if _built_symbolically(model) else 0
    if error is None and not states:
        return
    layers = keras_compat.sublayers(model, include_self=True, recursive=True)
    key = tuple(id(layer) for layer in layers)
    if _REBUILD_CHECKED.get(model) == key:
        return
    try:
        with keras_compat.unchanged_object_names(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras warns of the failing symbolic build
            copy = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    except Exception:  # a config that does not rebuild: the load reports what is missing
        return
    found = (len(copy.weights) if copy.built else 0), _rnn_state_count(copy)
    if found != (len(model.weights), states):
        if error is not None:
            raise error
        name = type(model).__name__
        raise ModelNotReadyError(
            f"Model {model.name!r} ({name}) has no build() of its own, so a load rebuilds it "
            f"from its build config {model.get_build_config()} by calling it on symbolic "
            f"inputs, which cannot create the states of a stateful RNN: the {backend!r} "
            f"backend would write a checkpoint that does not load. Define "
            f"build(self, input_shape) on {name} building its layers (for example "
            f"self.lstm.build(input_shape)). Received: rebuilt with {found[0]} weights and "
            f"{found[1]} RNN states, the model has {len(model.weights)} and {states}"
        )
    _REBUILD_CHECKED[model] = key
