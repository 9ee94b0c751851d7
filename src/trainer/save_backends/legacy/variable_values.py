"""Legacy variable values -> the imported Keras 3 layers, by object structure.

Each Keras 3 layer is paired with the legacy layer object at the same object path (a
model's layers by their unique names, sublayers by the attribute that holds them, such as
``cell`` or a custom layer's ``inner``). A layer's *own* variables are the ones in its
recorded ``variables`` list that none of its sublayers lists; they are assigned in
recorded order, trainable ones to trainable ones and the others to the others. Any
difference in count, shape or trainability is an ``UnsupportedLegacyError`` naming the
layer: a guess could load the model and make it compute something else. A stateful RNN's
states (``keras_api/states``, in no ``variables`` list) go to the Keras 3 layer's
``states``, in order.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer.errors import UnsupportedLegacyError
from trainer.save_backends.legacy.reader import LegacyDir, Node, top_level_layers

_MODEL_IDS = ("_tf_keras_network", "_tf_keras_model", "_tf_keras_sequential")


def layer_children(legacy: LegacyDir, node: Node) -> dict[str, Node]:
    """Attribute -> Keras layer node, for the layers ``node`` holds directly."""
    found = {}
    for attribute, node_id in legacy.children(node.node_id).items():
        child = legacy.nodes.get(node_id)
        if (
            child is not None
            and child.identifier.startswith("_tf_keras")
            and "metric" not in (child.identifier)
        ):
            if attribute.startswith("layer_with_weights-") or attribute == "keras_api":
                continue  # the same layers are listed again as layer-<i>
            found[attribute] = child
    return found


def own_legacy_variables(legacy: LegacyDir, node: Node) -> list[tuple[int, bool | None]]:
    """(variable node id, trainable) of the variables ``node`` owns, in recorded order.
    Trainable is the variable's own flag as ``saved_model.pb`` records it, as Keras 3
    splits a layer's variables: a frozen layer's ``trainable_variables`` list is empty
    (``trainable=False`` on it or on a model holding it), its variables' flags are not.

    A model saved with ``save_traces=False`` records no ``variables`` lists: its layers'
    variables are then their variable attributes in tracking (creation) order, and their
    trainability is not recorded (None); so are an adapted ``Normalization``'s (each listed
    twice: ``mean`` and ``adapt_mean``), counted once."""
    if "variables" not in legacy.children(node.node_id):
        found = legacy.children(node.node_id).values()  # one variable may have two names
        found = dict.fromkeys(v for v in found if legacy.value_key(v) is not None)
        return [(node_id, None) for node_id in found]
    inner: set[int] = set()
    for child in layer_children(legacy, node).values():
        inner.update(legacy.listed(child.node_id, "variables"))
    trainable = set(legacy.listed(node.node_id, "trainable_variables"))
    flags = legacy.saved_variables()
    own = [v for v in legacy.listed(node.node_id, "variables") if v not in inner]
    return [(v, flags[v].trainable if v in flags else v in trainable) for v in own]


def _attribute_sublayers(layer: keras.layers.Layer) -> dict[str, keras.layers.Layer]:
    """Attribute -> direct sublayer of ``layer`` (``name[i]`` for list items)."""
    found = {}
    for attribute, value in vars(layer).items():
        if isinstance(value, keras.layers.Layer):
            found[attribute] = value
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, keras.layers.Layer):
                    found[f"{attribute}[{i}]"] = item
    return found


def assign_model(legacy: LegacyDir, model: keras.Model, node: Node, where: str) -> None:
    """Assign every layer of the (Functional or Sequential) ``model`` from ``node``."""
    by_name = top_level_layers(legacy) if node.path == "root" else _layers_by_name(legacy, node)
    for layer in model.layers:
        source = by_name.get(layer.name)
        if source is None:
            if keras_compat.own_variables(layer) or layer.weights:
                raise UnsupportedLegacyError(
                    f"Layer {layer.name!r} of {where} has no counterpart in the legacy "
                    f"object graph, so its variables cannot be read. Received: "
                    f"{sorted(by_name)}"
                )
            continue
        assign_layer(legacy, layer, source, where)


def _layers_by_name(legacy: LegacyDir, node: Node) -> dict[str, Node]:
    found = {}
    for attribute, child in layer_children(legacy, node).items():
        if attribute.startswith("layer-"):
            found[child.metadata.get("name")] = child
    return found


def assign_layer(legacy: LegacyDir, layer: keras.layers.Layer, node: Node, where: str) -> None:
    """Assign ``layer``'s own variables from ``node`` and recurse into its sublayers."""
    if live_objects.get_marker(layer, live_objects.LEGACY_REVIVED, False):
        return  # a stand-in shares the loaded variables themselves
    if node.identifier in _MODEL_IDS and isinstance(layer, keras.Model):
        assign_model(legacy, layer, node, where)
        return
    source = own_legacy_variables(legacy, node)
    weights_ids = {id(v) for v in layer.weights}  # not the seed generators' RNG states
    target = [v for v in keras_compat.own_variables(layer) if id(v) in weights_ids]
    own_trainable = {id(v) for v in keras_compat.own_trainable_variables(layer)}
    if any(t is None for _, t in source):  # trainability not recorded: one ordered list
        _assign_list(legacy, layer, [v for v, _ in source], target, None, where)
    for flag in (True, False) if all(t is not None for _, t in source) else ():
        sources = [v for v, t in source if t == flag]
        targets = [v for v in target if (id(v) in own_trainable) == flag]
        _assign_list(legacy, layer, sources, targets, flag, where)
    if target and callable(getattr(layer, "finalize_state", None)):
        layer.finalize_state()  # as Keras' loaders do: Normalization's mean from adapt_mean
    _assign_states(legacy, layer, node, where)
    subs = _attribute_sublayers(layer)
    for attribute, child in layer_children(legacy, node).items():
        if attribute not in subs:
            raise UnsupportedLegacyError(
                f"Layer {layer.name!r} of {where} held a sublayer as {attribute!r} in "
                f"TensorFlow 2.x; the Keras 3 layer has no sublayer there, so its variables "
                f"cannot be placed. Received: sublayers {sorted(subs)}"
            )
        assign_layer(legacy, subs[attribute], child, where)


def _assign_states(legacy: LegacyDir, layer: keras.layers.Layer, node: Node, where: str):
    """A stateful RNN's states where it was saved: without them it would go on from zeros
    and compute another continuation of its sequences."""
    api = legacy.children(node.node_id).get("keras_api")
    holder = legacy.children(api).get("states") if api is not None else None
    saved = [] if holder is None else legacy.listed(api, "states")
    saved = [v for v in saved if legacy.value_key(v) is not None]
    stateful = isinstance(layer, keras.layers.RNN) and layer.stateful  # not wrappers
    states = layer.states if stateful else None
    targets = list(states) if isinstance(states, list | tuple) else []
    if not saved and not targets:
        return
    arrays = [legacy.read(v) for v in saved]
    shapes = [tuple(a.shape) for a in arrays]
    wanted = [tuple(getattr(v, "shape", ())) for v in targets]
    if shapes != wanted:
        raise UnsupportedLegacyError(
            f"Layer {layer.name!r} ({type(layer).__name__}) of {where} was saved with the "
            f"states of a stateful RNN that the Keras 3 layer cannot hold (Keras 3 "
            f"{wanted}, saved {shapes}), so it would continue from other states. If they "
            f"need not carry over, save the model again in TensorFlow 2.x with "
            f"stateful=False. Received: saved {shapes}"
        )
    for variable, array in zip(targets, arrays, strict=True):
        variable.assign(np.asarray(array, dtype=variable.dtype))


def _assign_list(legacy, layer, sources, targets, trainable, where) -> None:
    kind = {True: "trainable", False: "non-trainable", None: "own"}[trainable]
    arrays = [legacy.read(v) for v in sources]
    shapes = [tuple(a.shape) for a in arrays]
    wanted = [tuple(v.shape) for v in targets]
    if shapes != wanted:
        raise UnsupportedLegacyError(
            f"Layer {layer.name!r} ({type(layer).__name__}) of {where}: its {kind} variables "
            f"do not match the legacy ones (Keras 3 {wanted}, saved {shapes}); the weight "
            f"layouts differ, so it is not imported. Received: saved "
            f"{[legacy.variable_name(v) for v in sources]}"
        )
    for node_id, variable, array in zip(sources, targets, arrays, strict=True):
        variable.assign(np.asarray(array, dtype=variable.dtype))
        legacy.placed[node_id] = variable


def slot_arrays(legacy: LegacyDir) -> dict[str, Any]:
    """The legacy optimizer's saved state: ``iterations`` and its ``_variables`` list."""
    optimizer = legacy.children(legacy.root.node_id).get("optimizer")
    if optimizer is None:
        return {}
    children = legacy.children(optimizer)
    listed = legacy.listed(optimizer, "_variables")
    return {
        "iterations": children.get("_iterations") or children.get("iter"),
        "variables": [v for v in listed if legacy.value_key(v) is not None],
    }
