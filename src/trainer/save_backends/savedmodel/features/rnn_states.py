"""A stateful RNN's states, shared between the RNN rebuilt from its class and the traced
functions of a parent revived from its traces.

A stateful RNN (``LSTM(stateful=True)``) keeps its states in variables outside its weights;
its node holds them (``state_variables``), and every traced function that runs the RNN (its
own, and those of every layer above it) reads and updates those very variables. When a
parent is revived from its traced functions (its class missing, or not rebuildable from its
config) while the RNN itself is rebuilt from its class, the rebuilt RNN creates states of its
own: the parent's functions would go on with the loaded ones, and the RNN's ``states``,
``reset_state()`` and assignments would act on variables nothing reads (a model that loads
and computes the same, then silently behaves differently once its states are read, reset or
set). So the rebuilt RNN's states are pointed at the loaded variables, as its weights are.

A stateful RNN whose own class is missing is revived from its traced functions: its
stand-in (``standins.RevivedStatefulRNN``) is given as ``states`` Keras variables over the
same loaded variables, and ``reset_state()``, so code resetting or reading the states of
its stateful layers finds them (``layer_protocol.rnn_states`` too, so a save keeps them).

The save records which entries of the node's ``state_variables`` are the RNN's states, in
the RNN's order (``rnn_states`` in the layer's record); a checkpoint written before that was
recorded is matched when the node holds exactly the RNN's states.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer.errors import CorruptCheckpointError
from trainer.model_state import layer_protocol
from trainer.save_backends.savedmodel.features.keras_objects import variable_storage

RECORD_KEY = "rnn_states"


def record(layer: keras.layers.Layer, state: list[tf.Variable], into: dict[str, Any]) -> None:
    """Record in ``into`` (the layer's record) the positions of the layer's RNN states in
    ``state`` (what its node holds as ``state_variables``); nothing for other layers."""
    positions = {id(variable): i for i, variable in enumerate(state)}
    found = [positions.get(id(variable_storage(v))) for v in layer_protocol.rnn_states(layer)]
    if found and None not in found:
        into[RECORD_KEY] = found


def bind(layer: keras.layers.Layer, saved: dict[str, Any], node: Any, where: str) -> None:
    """Point the states of ``layer`` (rebuilt from its class) at the loaded variables its
    node holds, which the traced functions of its revived parents read and update. Nothing
    to do without the node (no traced function was imported: the states get their values
    from the layer state file) or for a layer without RNN states."""
    states = layer_protocol.rnn_states(layer)
    loaded = list(getattr(node, "state_variables", None) or []) if node is not None else []
    if not states or not loaded:
        return
    positions = saved.get(RECORD_KEY)
    if positions is None:  # written before the positions were recorded
        if len(loaded) != len(states) or not all(map(_fits, states, loaded)):
            return
        positions = list(range(len(states)))
    if (
        not isinstance(positions, list)
        or len(positions) != len(states)
        or not all(type(p) is int and 0 <= p < len(loaded) for p in positions)
        or not all(_fits(s, loaded[p]) for s, p in zip(states, positions, strict=True))
    ):
        raise CorruptCheckpointError(
            f"{where}: the saved states of stateful RNN layer {layer.name!r} do not fit it as "
            f"rebuilt from its class (states {[tuple(s.shape) for s in states]}, saved "
            f"{[tuple(v.shape) for v in loaded]}). The checkpoint is damaged or the class "
            f"changed since it was saved; load an older checkpoint. Received: "
            f"{RECORD_KEY}={positions!r:.200}"
        )
    for variable, position in zip(states, positions, strict=True):
        keras_compat.set_variable_storage(variable, loaded[position])


def expose(layer: keras.layers.Layer, saved: dict[str, Any], node: Any, where: str) -> None:
    """Give a stand-in revived from a stateful RNN's traced functions its ``states``: the
    loaded variables those functions read and update (``standins.RevivedStatefulRNN``)."""
    positions = saved.get(RECORD_KEY)
    if not positions or not hasattr(type(layer), "reset_state"):
        return
    loaded = list(getattr(node, "state_variables", None) or [])
    if not isinstance(positions, list) or not all(
        type(p) is int and 0 <= p < len(loaded) for p in positions
    ):
        raise CorruptCheckpointError(
            f"{where}: the saved states of stateful RNN layer {layer.name!r} cannot be "
            f"found among the {len(loaded)} state variables of its node. The checkpoint is "
            f"damaged; load an older checkpoint. Received: {RECORD_KEY}={positions!r:.200}"
        )
    states = [
        keras_compat.variable_over_storage(loaded[p], name="rnn_state", trainable=False)
        for p in positions
    ]
    live_objects.set_untracked(layer, "states", states)  # as Keras keeps an RNN's states


def _fits(variable: keras.Variable, storage: Any) -> bool:
    return tuple(variable.shape) == tuple(storage.shape) and (
        tf.as_dtype(variable.dtype) == storage.dtype
    )
