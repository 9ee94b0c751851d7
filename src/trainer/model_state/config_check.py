"""Refuse a model whose layers' configs do not hold what their Python attributes do.

Every backend rebuilds a layer of a known class from its ``get_config()`` (h5, weights,
savedmodel; also the async save's shadow model). A user's layer whose ``get_config`` leaves
out a constructor argument (``alpha=2.0`` rebuilt as the default ``1.0``), or whose call uses
an attribute set after construction (``layer.scale = 3.0``), comes back computing something
else, and Keras's own ``.keras`` reloads it so without a word. Before the first save of a
model, each layer of a user's class is rebuilt from its own config (constructor only: not
built, no weights) and its public attributes holding plain values (numbers, strings,
booleans, None, tuples and lists of those) are compared with the live layer's. A
difference is refused at save time, naming the attribute: nothing is written that would
load "successfully" and compute otherwise.

A layer that keeps state its own way (``save_own_variables`` / ``save_assets``...)
restores those attributes itself and is not compared. Not seen: state in private
attributes (``_scale``), in objects, or set in ``build``; a Functional model of the user's
class (rebuilding it from its config builds every layer); a class whose ``from_config``
fails here (the load reports that itself). Keras's own classes are trusted. Checked once
per model and set of layers (``check``).
"""

from __future__ import annotations

import copy
import json
import weakref
from typing import Any

import keras

from trainer._compat import keras as keras_compat
from trainer.errors import ModelNotReadyError
from trainer.model_state import layer_protocol

# Public attributes Keras's Layer, Model and Trainer set themselves: compile and fit state,
# never part of a config (``compiled``, ``stop_training``...), or the same on both sides.
_KERAS_OWN = frozenset(
    {
        "autocast",
        "built",
        "compiled",
        "loss",
        "name",
        "steps_per_execution",
        "stop_training",
        "supports_jit",
        "supports_masking",
        "unrolled_steps_per_execution",
    }
)
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(model: keras.Model) -> None:
    """Raise ``ModelNotReadyError`` if a layer of a user's class loses a plain attribute
    when rebuilt from its config (once per model and set of layers)."""
    layers = keras_compat.sublayers(model, include_self=True, recursive=True)
    key = tuple(id(layer) for layer in layers)
    if _CHECKED.get(model) == key:
        return
    memo: dict[Any, dict[str, Any]] = {}
    lost = [found for layer in layers for found in lost_attributes(layer, memo)]
    if lost:
        name, attribute, live, rebuilt = lost[0]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        raise ModelNotReadyError(
            f"Layer {name!r}: its attribute {attribute!r} is {live!r}, but a copy rebuilt from "
            f"its get_config() has {rebuilt!r}{more}. Every backend (and Keras' .keras) "
            f"rebuilds a layer whose class is known from its config, so the loaded model "
            f"would compute with {rebuilt!r}. Pass it to the constructor and return it "
            f"from get_config(), or keep it in a weight. Received: {attribute}={live!r}"
        )
    _CHECKED[model] = key


def lost_attributes(
    layer: keras.layers.Layer, rebuilt_by_config: dict[Any, dict[str, Any]] | None = None
) -> list[tuple[str, str, Any, Any]]:
    """``(layer name, attribute, live value, rebuilt value)`` for each plain public
    attribute of a user's layer that its config does not carry. ``rebuilt_by_config``: a
    memo of the plain attributes rebuilt per class and config (a model's repeated blocks
    differ in their names only: one rebuild serves them all)."""
    cls = type(layer)
    if cls.__module__.startswith("keras.") or keras_compat.is_functional(layer):
        return []
    if layer_protocol.keeps_own_state(layer):  # its own save/load methods restore that state
        return []
    try:
        config = layer.get_config()
        key = _config_key(cls, config)
        memo = {} if rebuilt_by_config is None else rebuilt_by_config
        if key not in memo:
            rebuilt = _rebuilt_from(cls, config)
            memo[key] = {k: v for k, v in vars(rebuilt).items() if _compared(k, v)}
        fresh = memo[key]
    except Exception:  # cannot tell here; a load reports a config that does not rebuild
        return []
    return [
        (layer.name, attribute, value, fresh[attribute])
        for attribute, value in vars(layer).items()
        if _compared(attribute, value) and attribute in fresh and value != fresh[attribute]
    ]


def _config_key(cls: type, config: dict[str, Any]) -> tuple[type, str]:
    """Layers of one class whose configs differ only in their names rebuild alike (a
    model's repeated blocks): one rebuild serves them all."""
    return cls, json.dumps({**config, "name": None}, sort_keys=True, default=repr)


def _rebuilt_from(cls: type, config: dict[str, Any]) -> keras.layers.Layer:
    """A dropped copy built from ``config`` by the class's own ``from_config`` (constructor
    only: not built, no weights), leaving Keras's automatic names as they were."""
    with keras_compat.unchanged_object_names():
        return cls.from_config(plain_copy(config))


def plain_copy(value: Any) -> Any:
    """A deep copy of a config with every list and dict as a plain one, as a load gets it
    back from JSON. A Keras layer's config may hold its own tracked list (Keras 3.15's
    ``RandomBrightness`` returns its ``value_range`` attribute), which keeps a reference
    to the layer's tracker and cannot be deep-copied, although Keras's saving writes it as
    a list."""
    if isinstance(value, dict):
        return {key: plain_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_copy(item) for item in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(plain_copy(item) for item in value)
    return copy.deepcopy(value)


def _compared(attribute: str, value: Any) -> bool:
    return not attribute.startswith("_") and attribute not in _KERAS_OWN and _plain(value)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    return isinstance(value, tuple | list) and all(_plain(v) for v in value)


# ------------------------------------------------------------ config-held values over time
# Config keys a layer also holds as public attributes of plain values, found once per layer.
_HELD_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NOT_HELD = frozenset({"name", "trainable", "dtype"})  # compared elsewhere, or not plain


def held_values(layer: keras.layers.Layer) -> tuple[tuple[str, Any], ...]:
    """``(attribute, value)`` for each entry of the layer's config that it also holds as a
    public attribute of a plain value (``Dropout.rate``, ``Discretization.bin_boundaries``).
    Such a value can change between two saves of one model (a schedule lowering a dropout
    rate, a re-``adapt``): what is saved must then follow, where a save reuses what an
    earlier one made (the savedmodel trace cache, the async shadow). Read on every save:
    the config itself is read once per layer; a Functional or Sequential model (whose
    config is its graph) holds none."""
    keys = _HELD_KEYS.get(layer)
    if keys is None:
        keys = _held_keys(layer)
        _HELD_KEYS[layer] = keys
    found = []
    for key in keys:
        value = getattr(layer, key, None)
        if _plain(value):
            found.append((key, value))
    return tuple(found)


def _held_keys(layer: keras.layers.Layer) -> tuple[str, ...]:
    if _rebuilds_its_layers(layer):  # its config is its graph, read for nothing
        return ()
    try:
        config = layer.get_config()
    except Exception:  # a config that cannot be read is reported by the save itself
        return ()
    attributes = vars(layer)
    return tuple(
        key
        for key in config
        if key not in _NOT_HELD and key in attributes and _compared(key, attributes[key])
    )


def copy_held_values(source: keras.Model, target: keras.Model) -> None:
    """Give each layer of ``target`` (same architecture, layers in the same order) the
    config-held values of its twin in ``source`` that differ (``held_values``)."""
    mine = keras_compat.sublayers(source, include_self=True)
    theirs = keras_compat.sublayers(target, include_self=True)
    for source_layer, target_layer in zip(mine, theirs, strict=False):
        if type(source_layer) is not type(target_layer):
            continue
        for key, value in held_values(source_layer):
            if getattr(target_layer, key, None) != value:
                setattr(target_layer, key, copy.deepcopy(value))


# ------------------------------------------------------- Keras's own configs that do not load
_REBUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def refuse_unrebuildable(model: keras.Model, backend: str) -> None:
    """Raise ``ModelNotReadyError`` if a layer of one of Keras's own classes cannot be
    rebuilt from its own ``get_config()`` (once per model and set of layers). A backend
    that rebuilds every layer from its config (h5, weights) would write a checkpoint no
    load can read: Keras 3.15's ``RandomShear`` writes ``x_factor=(-0.2, 0.2)``, which its
    constructor refuses, and every load said the checkpoint was damaged. A user's class is
    rebuilt by ``check`` (its failures are left to the load, which reports what is
    missing), and so is a Keras layer whose config names an object of the user's
    (``names_only_keras``): the load may be given it."""
    layers = _rebuilt_by_the_load(model)
    key = tuple(id(layer) for layer in layers)
    if _REBUILT.get(model) == key:
        return
    seen: set[Any] = set()
    for layer in layers:
        cls = type(layer)
        if not cls.__module__.startswith("keras.") or isinstance(layer, keras.layers.Lambda):
            continue  # a Lambda's code is the load's safe mode to allow or refuse
        try:
            config = layer.get_config()
            if not names_only_keras(config):
                continue  # an object of the user's, which a load may be given
            memo = _config_key(cls, config)
            if memo in seen:
                continue
            seen.add(memo)
            _rebuilt_from(cls, config)
        except Exception as err:
            if "safe_mode" in str(err):
                continue  # code, which the load's safe mode allows or refuses
            raise ModelNotReadyError(
                f"Layer {layer.name!r}: Keras's own {cls.__name__} cannot be rebuilt from its "
                f"get_config() ({type(err).__name__}: {str(err)[:200]}). The {backend} backend "
                f"rebuilds every layer from its config, so no load could read this checkpoint. "
                f"Save with save=savedmodel (it revives such a layer from its traced "
                f"functions), or leave the layer out of the saved model. Received: "
                f"{cls.__name__} config {str(config)[:200]}"
            ) from None
    _REBUILT[model] = key


def _rebuilt_by_the_load(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers a load rebuilds from their own configs: a Functional or Sequential
    model's layers, and those of such models among them. A layer's sublayers (an RNN's
    cell, a wrapper's layer) are rebuilt by its own ``from_config``, with what it passes
    them (a ``ConvLSTMCell`` alone lacks its rank), and are checked through it."""
    found: list[keras.layers.Layer] = []
    pending = [model]
    while pending:
        current = pending.pop()
        if not _rebuilds_its_layers(current):
            continue  # a subclassed model's __init__ makes its layers, not their configs
        for layer in current.layers:
            (pending if isinstance(layer, keras.Model) else found).append(layer)
    return found


def _rebuilds_its_layers(layer: keras.layers.Layer) -> bool:
    """A Functional or Sequential model: its config is its layers' configs and graph."""
    return keras_compat.is_functional(layer) or isinstance(layer, keras.Sequential)


def _is_keras_module(module: Any) -> bool:
    return isinstance(module, str) and (module == "keras" or module.startswith("keras."))


def names_only_keras(config: Any) -> bool:
    """Whether every object the config names is Keras' own: a registered class or function
    of the user's (``"registered_name": "package>Name"``, a module of theirs) may be
    missing where the checkpoint is loaded, and the layer then needs its traces."""
    if config is None:
        return False
    custom = keras.saving.get_custom_objects()
    pending = [config]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            named = "class_name" in value and "module" in value
            if named and (not _is_keras_module(value["module"]) or value.get("registered_name")):
                return False
            pending.extend(value.values())
        elif isinstance(value, list | tuple):
            pending.extend(value)
        elif isinstance(value, str) and value in custom:
            return False
    return True
