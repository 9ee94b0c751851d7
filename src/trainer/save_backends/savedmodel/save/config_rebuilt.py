"""The layers every load rebuilds from their Keras config: their traced calls would never run.

Traced call functions are what a load falls back on when a layer's class is missing or
cannot rebuild it (revival, step 3). A layer of one of Keras' own classes, whose config
names only Keras' own objects and holds no Python code, always has its class where trainer
loads (trainer needs Keras), and if rebuilding it from that config gives the variables the
save stored, every load rebuilds it that way (step 2). Its own traces would never run: on
the benchmark models they were a quarter of a first save, three quarters of the functions
stored (issue 17, "trace only what revival or serving will call"). Such a layer gets no
call functions of its own; a parent that does get traced holds its ops inline, as
``model.export`` holds every layer's.

"Rebuilding gives the same variables" is not assumed but tried, the way the loader tries it,
on a copy that is dropped: built from the saved build config with its variables left at
zeros (their initializers do not run), then compared by position, shape and dtype. A layer
whose copy differs (a build config that does not rebuild every variable) keeps its traces,
which the loader then calls to build it. The copy leaves nothing behind: Python's random
state (Keras draws default seeds from it) and Keras' automatic-name counters are restored.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from typing import Any

import keras

from trainer._compat import initializers
from trainer._compat import keras as keras_compat
from trainer.model_state import config_check, readiness
from trainer.save_backends.savedmodel import records
from trainer.save_backends.savedmodel.save import state_variables, tracing

log = logging.getLogger(__name__)


def layers_rebuilt_from_config(
    layers: list[keras.layers.Layer], configs: list[tuple[dict[str, Any] | None, str | None]]
) -> set[int]:
    """Ids of the layers in ``layers`` that every load rebuilds from their config;
    ``configs``: ``records.keras_config`` of each, what the save records."""
    pairs = zip(layers, configs, strict=True)
    candidates = [(layer, config) for layer, (config, _) in pairs if _keras_own_layer(layer)]
    if not candidates:
        return set()
    found: set[int] = set()
    tried: dict[str, bool] = {}  # layers alike but for their names are tried once
    python_random = random.getstate()
    try:
        with keras_compat.unchanged_object_names():
            for layer, config in candidates:
                if records.carries_code(config, layer) or not config_check.names_only_keras(config):
                    continue
                key = _alike_key(layer, config)
                if key not in tried:
                    tried[key] = _rebuilds_alike(layer, config)
                if tried[key]:
                    found.add(id(layer))
    finally:
        random.setstate(python_random)
    return found


def _alike_key(layer: keras.layers.Layer, config: dict[str, Any]) -> str:
    """What decides the rebuild: the config but for the layer's own name, its build config
    and its variables' shapes and dtypes (the 32 Dense layers of the large benchmark model's
    blocks are tried as one)."""
    inner = config.get("config")
    unnamed = {**config, "config": {**inner, "name": None}} if isinstance(inner, dict) else config
    own = [(list(v.shape), str(v.dtype)) for v in layer.variables]
    return json.dumps([unnamed, layer.get_build_config(), own], sort_keys=True, default=str)


def _keras_own_layer(layer: keras.layers.Layer) -> bool:
    """A plain layer (not a model) of one of Keras' own classes, holding no state outside
    its Keras variables (lookup tables, metrics, a stateful RNN's states): the loader's
    config path handles those through their own traces or assets."""
    if records.original_identity(layer) is not None:
        return False
    if isinstance(layer, keras.Model | keras.layers.Lambda):
        return False
    if not type(layer).__module__.startswith("keras.src."):
        return False
    if readiness.overrides_call(layer) or tracing.trackable_resources(layer):
        return False
    return not state_variables.state_variables(layer)


def _rebuilds_alike(layer: keras.layers.Layer, config: dict[str, Any]) -> bool:
    """Whether the loader's config path (deserialize, ``build_from_config``) rebuilds the
    layer with the variables it has, compared as the loader binds them: by name within
    the layer where the names tell, else by position; then shape and dtype."""
    config = copy.deepcopy(config)
    config.pop("build_config", None)
    build_config = layer.get_build_config()
    try:
        with initializers.DeferredInitializers():
            clone = keras.saving.deserialize_keras_object(config, safe_mode=True)
            if not clone.built and build_config:
                clone.build_from_config(build_config)
            rebuilt = list(clone.variables)
    except Exception as err:  # Keras' own from_config / build failing: keep the traces
        log.debug("Layer %r keeps its traced calls: %s: %s", layer.name, type(err).__name__, err)
        return False
    live = list(layer.variables)
    order = records.rebuilt_order(
        [(v.name, v.path) for v in rebuilt], [(v.name, v.path) for v in live]
    )
    if order is not None:  # the loader binds by name then (a float8-quantized Dense)
        live = [live[i] for i in order]
    return [(tuple(v.shape), v.dtype) for v in rebuilt] == [(tuple(v.shape), v.dtype) for v in live]
