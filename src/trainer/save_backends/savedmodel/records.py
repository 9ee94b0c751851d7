"""Per-layer metadata records: what a loader needs to rebuild each layer.

A record says how to rebuild a layer from its config when the class is available, and
where its traced functions and variables live in the object graph when it is not. Records
are plain JSON; nothing here is code, so reading them can never execute anything.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import keras

from trainer._compat import keras as keras_compat
from trainer._compat import keras_inputs as inputs_compat
from trainer._compat import live_objects
from trainer.errors import ModelNotReadyError
from trainer.save_backends.savedmodel.features import constraints, training_logic

log = logging.getLogger(__name__)
CODE_MARKERS = ('"__lambda__"', '"function_type": "lambda"', '"marshal"')
# Key of the placeholder a graph config holds for a layer whose own config is not usable
# (``_placeholders``); the loader puts the layer revived from its traces in its place.
PLACEHOLDER = "__trainer_config_missing__"


def registered_name(cls: type) -> str:
    return keras.saving.get_registered_name(cls)


def original_identity(layer: keras.layers.Layer) -> dict[str, Any] | None:
    """A revived layer reports the class it stands for, so a re-save stays revivable."""
    return live_objects.get_marker(layer, live_objects.ORIGINAL_IDENTITY)


def keras_config(layer: keras.layers.Layer) -> tuple[dict[str, Any] | None, str | None]:
    """``serialize_keras_object(layer)`` if it is JSON-able, else (None, reason).

    Two fallbacks keep a config where one part of the user's serialization code fails:
    a failing ``get_build_config`` leaves only the build config out (the loader builds the
    layer by a call instead), and a Functional / Sequential whose graph holds a layer
    without a usable config keeps its graph with a placeholder for that layer's config
    (that layer revives from its traced functions, the graph around it from config)."""
    original = original_identity(layer)
    if original is not None:
        return original.get("keras_config"), original.get("config_error")
    config, reason = _serialized(layer)
    if config is None:
        with _placeholders([layer], configs=False):
            config, _ = _serialized(layer)
    if config is None and model_kind(layer) in ("functional", "sequential"):
        config = _graph_with_placeholders(layer)
    if config is None:
        log.warning(
            "Layer %r (%s) has no usable config (%s): it will be revived from its traced "
            "functions, also when its class is available.",
            layer.name,
            type(layer).__name__,
            reason,
        )
        return None, reason
    return config, None


def _serialized(layer: keras.layers.Layer) -> tuple[dict[str, Any] | None, str | None]:
    try:
        config = keras.saving.serialize_keras_object(layer)
        json.dumps(config)
    except Exception as err:  # the layer's own get_config / get_build_config: user code
        return None, f"{type(err).__name__}: {err}"[:300]
    return config, None


@contextlib.contextmanager
def _placeholders(layers: list[keras.layers.Layer], *, configs: bool) -> Iterator[list[str]]:
    """While active, each layer's ``get_build_config`` returns None and (if ``configs``)
    a ``get_config`` still failing then returns a placeholder naming the layer and why
    its config is missing; yields the names of the layers given a placeholder.

    Methods of these instances alone (``live_objects.patch_method``), put back afterwards,
    so the classes and every other instance are untouched."""
    restorers: list[Callable[[], None]] = []
    given_placeholder: list[str] = []
    try:
        for layer in layers:
            restorers.append(live_objects.patch_method(layer, "get_build_config", _no_build_config))
            config, reason = _serialized(layer) if configs else ({}, None)
            if config is None:
                stub = {"name": layer.name, PLACEHOLDER: reason}
                placeholder = _placeholder_config(stub)
                restorers.append(live_objects.patch_method(layer, "get_config", placeholder))
                given_placeholder.append(layer.name)
        yield given_placeholder
    finally:
        for restore in reversed(restorers):
            restore()


def _no_build_config() -> None:
    return None


def _placeholder_config(stub: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    def get_config() -> dict[str, Any]:
        return dict(stub)  # a fresh copy at each call

    return get_config


def _unserializable_graph_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers of a Functional / Sequential graph (and of the graphs nested in it)
    whose own serialization fails."""
    found: dict[int, keras.layers.Layer] = {}  # a layer shared by nested graphs: once
    for layer in keras_compat.sublayers(model, recursive=False):
        if model_kind(layer) in ("functional", "sequential"):
            found.update((id(inner), inner) for inner in _unserializable_graph_layers(layer))
        elif _serialized(layer)[0] is None:
            found[id(layer)] = layer
    return list(found.values())


def _graph_with_placeholders(model: keras.layers.Layer) -> dict[str, Any] | None:
    failing = _unserializable_graph_layers(model)
    if not failing:
        return None
    with _placeholders(failing, configs=True) as stubbed:
        config, _ = _serialized(model)
    if config is not None and stubbed:
        log.warning(
            "Model %r: its graph config holds a placeholder for the config of %s, revived "
            "from traced functions inside the graph rebuilt from config.",
            model.name,
            ", ".join(map(repr, stubbed)),
        )
    return config


def _stored_or_fallback(
    fallbacks: dict[str, str], what: str, owner: str, produce: Callable[[], Any], fallback: Any
) -> Any:
    """``produce()`` runs the layer's (user's) own serialization code; if it fails, the
    record keeps ``fallback``, and why is logged and kept in ``fallbacks`` (saved with the
    record as ``save_fallbacks``) instead of being dropped silently."""
    try:
        value = produce()
        json.dumps(value)
        return value
    except Exception as err:  # user code: any failure is its own, reported as such
        reason = f"{type(err).__name__}: {err}"[:300]
        log.warning("%s: its %s could not be stored (%s); kept %r.", owner, what, reason, fallback)
        fallbacks[what] = reason
        return fallback


# A layer built on a ``tf.Tensor``'s shape records a ``TensorShape`` in its build config,
# which JSON cannot hold: without this the record kept no build config, and every load then
# failed as though the class were missing.
plain_shapes = inputs_compat.plain_shapes


def carries_code(config: dict[str, Any] | None, layer: keras.layers.Layer) -> bool:
    if isinstance(layer, keras.layers.Lambda):
        return True
    text = json.dumps(config) if config is not None else ""
    return any(marker in text for marker in CODE_MARKERS)


def model_kind(layer: keras.layers.Layer) -> str | None:
    if original_identity(layer) is not None:
        return original_identity(layer).get("model_kind")
    if isinstance(layer, keras.Sequential):
        return "sequential"
    if keras_compat.is_functional(layer):
        return "functional"
    if isinstance(layer, keras.Model):
        return "subclassed"
    return None


def is_graph_config(kind: str | None, config: Any) -> bool:
    """Whether a layer of this ``model_kind`` and config is revived as a graph: Keras
    rebuilds a Functional / Sequential config around its revived layers, so such a layer
    is never revived from its own traced functions. A subclass whose own get_config
    returns its constructor's arguments instead is rebuilt like any other layer (or from
    traces)."""
    inner = config.get("config") if isinstance(config, dict) else None
    if kind not in ("functional", "sequential") or not isinstance(inner, dict):
        return False
    if not isinstance(inner.get("layers"), list):
        return False
    return kind == "sequential" or all(k in inner for k in ("input_layers", "output_layers"))


def child_attributes(layer: keras.layers.Layer, child: keras.layers.Layer) -> list[str]:
    """Attribute names under which ``layer`` holds ``child`` (``"blocks[1]"`` for lists)."""
    names = []
    for attr, value in vars(layer).items():
        if attr.startswith("_") and attr not in ("_layers",):
            continue
        if value is child:
            names.append(attr)
        elif isinstance(value, list | tuple) and attr != "_layers":
            names.extend(f"{attr}[{i}]" for i, item in enumerate(value) if item is child)
    return names


def call_signature(layer: keras.layers.Layer) -> list[dict[str, Any]] | None:
    """The parameters of the layer's ``call`` (name, kind, plain default): a layer revived
    from traces takes calls exactly as the original did, also one whose first input is
    passed by keyword (``attention(query=x, value=x)``). While tracing replaces ``call``
    on the instance, the class's ``call`` is inspected; None if it has no signature."""
    call = type(layer).call if "call" in vars(layer) else layer.call
    try:
        parameters = list(inspect.signature(call).parameters.values())
    except (TypeError, ValueError):  # a builtin or otherwise uninspectable call
        return None
    if call is type(layer).call:  # the class's function: its first parameter is self
        parameters = parameters[1:]
    found = []
    for parameter in parameters:
        entry: dict[str, Any] = {"name": parameter.name, "kind": parameter.kind.name}
        default = parameter.default
        if default is not inspect.Parameter.empty:
            plain = default is None or isinstance(default, bool | int | float | str)
            entry["default"] = default if plain else None
            if not plain:  # stored as None: a revived call tells it from an explicit None
                entry["opaque"] = True
        found.append(entry)
    return found


def input_spec_config(layer: keras.layers.Layer, fallbacks: dict[str, str]) -> Any:
    spec = getattr(layer, "input_spec", None)
    if spec is None:
        return None
    specs = spec if isinstance(spec, list | tuple) else [spec]
    owner = f"Layer {layer.name!r}"
    return [
        _stored_or_fallback(
            fallbacks,
            f"input_spec[{i}]",
            owner,
            lambda item=item: item.get_config() if item is not None else None,
            repr(item),
        )
        for i, item in enumerate(specs)
    ]


def dtype_policy_config(layer: keras.layers.Layer, fallbacks: dict[str, str]) -> Any:
    return _stored_or_fallback(
        fallbacks,
        "dtype_policy",
        f"Layer {layer.name!r}",
        lambda: keras.saving.serialize_keras_object(layer.dtype_policy),
        layer.dtype_policy.name,
    )


def layer_record(
    layer: keras.layers.Layer,
    index: int,
    *,
    layer_index: dict[int, int],
    variable_index: dict[int, int],
    own_variables: list[int],
    functions: dict[str, Any],
    call_specs: list[str],
    serialized: tuple[dict[str, Any] | None, str | None] | None = None,
) -> dict[str, Any]:
    """The JSON record of one layer (see the on-disk layout in
    docs/explanation/savedmodel-format.md); ``serialized`` is ``keras_config(layer)`` if the
    caller already has it."""
    from trainer.save_backends.savedmodel.features.keras_objects import takes_training, tf_variable

    config, config_error = serialized if serialized is not None else keras_config(layer)
    original = original_identity(layer) or {}
    children = [c for c in keras_compat.tracked_sublayers(layer) if id(c) in layer_index]
    fallbacks: dict[str, str] = {}
    owner = f"Layer {layer.name!r} ({type(layer).__name__})"
    build_config = _stored_or_fallback(
        fallbacks, "build_config", owner, lambda: plain_shapes(layer.get_build_config()), None
    )
    return {
        "id": index,
        "name": layer.name,
        "class_name": original.get("class_name", type(layer).__name__),
        "module": original.get("module", type(layer).__module__),
        "registered_name": original.get("registered_name", registered_name(type(layer))),
        "keras_config": config,
        "config_error": config_error,
        "carries_code": original.get("carries_code", carries_code(config, layer)),
        "model_kind": model_kind(layer),
        "trainable": bool(layer.trainable),
        "dtype_policy": dtype_policy_config(layer, fallbacks),
        "build_config": build_config,
        "takes_training": takes_training(layer),
        "call_signature": call_signature(layer),
        "supports_masking": bool(layer.supports_masking),
        "input_spec": input_spec_config(layer, fallbacks),
        "sublayers": [
            {"id": layer_index[id(c)], "attributes": child_attributes(layer, c)} for c in children
        ],
        "variables": [variable_index[id(tf_variable(v))] for v in layer.variables],
        "own_variables": own_variables,
        "trainable_variables": [
            variable_index[id(tf_variable(v))] for v in layer.trainable_variables
        ],
        "functions": functions,
        "call_specs": call_specs,
        "save_fallbacks": fallbacks,  # what could not be stored, and why
        "training_logic": training_logic.overridden(layer),
        "computation_overrides": training_logic.computation_overridden(layer),
    }


def variable_record(variable: Any, index: int, owner: int | None) -> dict[str, Any]:
    regularizer = getattr(variable, "regularizer", None)
    reg_config, fallbacks = None, {}
    if regularizer is not None:  # a config-less regularizer still runs from its trace
        reg_config = _stored_or_fallback(
            fallbacks,
            "regularizer",
            f"Variable {getattr(variable, 'path', variable.name)!r}",
            lambda: keras.saving.serialize_keras_object(regularizer),
            None,
        )
    return {
        "index": index,
        "path": getattr(variable, "path", variable.name),
        "name": getattr(variable, "name", None),
        "shape": [int(d) if d is not None else None for d in variable.shape],
        "dtype": str(keras.backend.standardize_dtype(variable.dtype)),
        "trainable": bool(getattr(variable, "trainable", True)),
        "owner": owner,
        "node_path": f"model_variables/{index}",
        "has_regularizer": regularizer is not None,
        "constraint": constraints.config(variable),
        "regularizer": reg_config,
        "save_fallbacks": fallbacks,
    }


def check_json(value: Any, what: str) -> None:
    """Fail before writing anything if ``value`` is not JSON-able."""
    try:
        json.dumps(value)
    except TypeError as err:
        raise ModelNotReadyError(
            f"The {what} cannot be serialized to JSON ({err}). Use registered Keras "
            f"objects or strings instead of Python objects. Received: {value!r}"[:600]
        ) from None


def rebuilt_order(
    rebuilt: list[tuple[str | None, str | None]], saved: list[tuple[str | None, str | None]]
) -> list[int] | None:
    """For each variable of a layer rebuilt from its config, given as (name, path), the
    position among the saved layer's variables of the one with its name (or, where names
    repeat, as a model's do, its path), when those are distinct on each side and the
    same; None otherwise (bind by position, as before).

    A rebuilt layer may create its variables in another order than the live one did, and
    a bind by position would then pair variables of equal shapes wrongly without a word:
    ``model.quantize("float8")`` adds a Dense's six scale and amax-history variables
    after its kernel and bias, while the Dense Keras rebuilds from the float8 config
    creates them first. Within one layer a variable's name is what Keras itself keys it
    by, so names decide where they can."""
    for key in (0, 1):
        mine, theirs = [v[key] for v in rebuilt], [v[key] for v in saved]
        distinct = len(set(mine)) == len(mine) and len(set(theirs)) == len(theirs)
        if None not in mine and distinct and set(mine) == set(theirs):
            where = {name: i for i, name in enumerate(theirs)}
            return [where[name] for name in mine]
    return None
