"""Keras's per-layer state protocol, honoured by every backend.

A Keras layer may keep state that is not a plain variable, or must be post-processed after
its variables are set, and says how to store it by overriding four public methods:
``save_own_variables(store)`` / ``load_own_variables(store)`` (a dict of arrays) and
``save_assets(dir)`` / ``load_assets(dir)`` (files). Adapted ``Normalization`` recomputes
its cached mean and variance in ``load_own_variables``; adapted ``StringLookup`` /
``IntegerLookup`` / ``TextVectorization`` keep their vocabulary as an asset. Copying
variables by position skips all of that and loads "successfully" with wrong outputs, so a
backend stores every layer's state through these methods instead.

A stateful RNN's states (what it carries from batch to batch) are kept with its state too,
under keys of their own: Keras keeps them out of both its variables and that protocol.

Layers are visited in one deterministic order (the model first, then every sublayer once,
in Keras's own tracking order), and matched by position: the loading process rebuilds the
same architecture, so the order is the same; layer names are kept only as labels and
checked. A layer's own hook raising is reported as that layer's failure, never as a
damaged checkpoint.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import keras
import numpy as np

from trainer._compat import live_objects
from trainer._compat.keras import (
    loads_own_variables_by_position,
    merges_lora_when_saved,
    sublayers,
)
from trainer.errors import CorruptCheckpointError, IncompatibleFormatError, LayerStateError


@dataclass
class LayerState:
    """What one layer stores: its ``save_own_variables`` dict and its asset files."""

    name: str
    class_name: str
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    assets: dict[str, bytes] = field(default_factory=dict)  # relative path -> content


def stateful_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model and every sublayer, each once, in the order both sides agree on."""
    return sublayers(model, include_self=True, recursive=True)


def collect(model: keras.Model) -> list[LayerState]:
    """Every layer's state, as its own ``save_own_variables`` / ``save_assets`` give it."""
    return [collect_one(layer) for layer in stateful_layers(model)]


def collect_one(layer: keras.layers.Layer) -> LayerState:
    """One layer's state, as its own ``save_own_variables`` / ``save_assets`` give it."""
    state = LayerState(layer.name, type(layer).__name__)
    store: dict[str, object] = {}
    if merges_lora_when_saved(layer):  # Keras's own method would merge the adapters away
        store.update((f"{VARIABLE_KEY}{i}", v) for i, v in enumerate(layer.variables))
    else:
        _call(layer, "save_own_variables", store, saving=True)
    for i, variable in enumerate(rnn_states(layer)):  # kept apart from Keras's own keys
        store[f"{RNN_STATE_KEY}{i}"] = variable
    state.arrays = {key: np.asarray(keras.ops.convert_to_numpy(v)) for key, v in store.items()}
    if hasattr(layer, "save_assets"):
        with tempfile.TemporaryDirectory(prefix="trainer-assets-") as scratch:
            _call(layer, "save_assets", scratch, saving=True)
            state.assets = _read_tree(Path(scratch))
    return state


def restore(model: keras.Model, states: list[LayerState], where: str) -> None:
    """Give every layer of ``model`` its stored state through ``load_own_variables`` and
    ``load_assets``; the layers must match the stored ones in number and class."""
    layers = stateful_layers(model)
    if len(layers) != len(states):
        raise CorruptCheckpointError(
            f"{where} holds the state of {len(states)} layers but the model rebuilt from its "
            f"config has {len(layers)}. The checkpoint is damaged or was written by a "
            f"different architecture. Received: {len(states)} layer states"
        )
    for layer, state in zip(layers, states, strict=True):
        if type(layer).__name__ != state.class_name:
            raise CorruptCheckpointError(
                f"{where}: layer {layer.name!r} is a {type(layer).__name__} but the stored "
                f"state at its position is for a {state.class_name} ({state.name!r}). The "
                f"checkpoint is damaged or was written by a different architecture. "
                f"Received: {state.class_name}"
            )
        restore_one(layer, state)


def restore_one(layer: keras.layers.Layer, state: LayerState) -> None:
    """``load_own_variables`` then ``load_assets``, in Keras's order; then a stateful
    RNN's states."""
    arrays = dict(state.arrays)
    states = [arrays.pop(key) for key in sorted(arrays, key=_rnn_state_position) if _is_rnn(key)]
    if merges_lora_when_saved(layer):
        _restore_lora_layer(layer, arrays)
    else:
        _call(layer, "load_own_variables", arrays, saving=False)
    if hasattr(layer, "load_assets"):  # as Keras does: even with no stored file
        with tempfile.TemporaryDirectory(prefix="trainer-assets-") as scratch:
            _write_tree(Path(scratch), state.assets)
            _call(layer, "load_assets", scratch, saving=False)
    if states:  # none stored: written before trainer kept them (they start at zero)
        restore_rnn_states(layer, states, "the checkpoint")


RNN_STATE_KEY = "trainer:rnn_state:"
VARIABLE_KEY = "trainer:variable:"  # a LoRA layer's variables, stored as they are


def _restore_lora_layer(layer: keras.layers.Layer, arrays: dict[str, np.ndarray]) -> None:
    """Assign a LoRA layer's variables stored as they are; refuse Keras's merged form."""
    keys = [f"{VARIABLE_KEY}{i}" for i in range(len(arrays))]
    if set(keys) != set(arrays):
        raise merged_lora_error(layer, f"keys {sorted(arrays)[:6]}")
    what = f"The stored variables of LoRA layer {layer.name!r}"
    assign_exact(layer.variables, [arrays[k] for k in keys], what)


def merged_lora_error(layer: keras.layers.Layer, received: str) -> IncompatibleFormatError:
    return IncompatibleFormatError(
        f"Layer {layer.name!r} ({type(layer).__name__}) has LoRA enabled, and this checkpoint "
        f"stored it the way Keras's own save_own_variables does: the adapters merged into the "
        f"kernel, which loses them (they would load as zeros and never train again). It was "
        f"written by an older trainer; load it with that version and save it again, or "
        f"retrain. Received: {received}"
    )


def assign_exact(variables: list, arrays: list[np.ndarray], what: str, hint: str = "") -> None:
    """Assign ``arrays`` to ``variables`` one by one, refusing any count or shape mismatch
    (``what``: whose variables, for the message; ``hint``: a likely cause, if any)."""
    shapes = [tuple(v.shape) for v in variables]
    received = [tuple(np.shape(a)) for a in arrays]
    if shapes != received:
        raise CorruptCheckpointError(
            f"{what} do not fit it as rebuilt (shapes {shapes}). The checkpoint is damaged or "
            f"was written by another architecture{hint}. Received shapes: {received}"
        )
    for variable, value in zip(variables, arrays, strict=True):
        variable.assign(value)


def _per_layer(
    layers: list[keras.layers.Layer], counts: list[int], arrays: list[np.ndarray], what: str
):
    """``(layer, its arrays)`` for arrays stored layer after layer, ``counts[i]`` each;
    a total that differs is refused (``what``: what they are, for the message)."""
    if sum(counts) != len(arrays):
        raise CorruptCheckpointError(
            f"{what}: {len(arrays)} are stored but the model rebuilt from its config has "
            f"{sum(counts)}. The checkpoint is damaged or was written by another "
            f"architecture. Received: {len(arrays)} arrays"
        )
    start = 0
    for layer, count in zip(layers, counts, strict=True):
        yield layer, arrays[start : start + count]
        start += count


def _is_rnn(key: str) -> bool:
    return key.startswith(RNN_STATE_KEY)


def _rnn_state_position(key: str) -> int:
    suffix = key[len(RNN_STATE_KEY) :] if _is_rnn(key) else ""
    return int(suffix) if suffix.isdigit() else -1


def rnn_states(layer: keras.layers.Layer) -> list[keras.Variable]:
    """The state variables of a stateful RNN (``LSTM(stateful=True)``, ``ConvLSTM2D``...):
    what it carries from one batch to the next. Keras keeps them out of ``variables`` and
    ``save_own_variables`` (its ``.keras`` files reload them as zeros), so a checkpoint
    would silently restart every sequence; trainer stores them with the layer's state.
    A stand-in revived from a stateful RNN's traces (its class missing) has them too."""
    revived = live_objects.get_marker(layer, live_objects.REVIVED_FROM) and hasattr(
        layer, "reset_state"
    )
    if not (isinstance(layer, keras.layers.RNN) or revived) or not getattr(layer, "stateful", 0):
        return []
    return [v for v in keras.tree.flatten(layer.states or []) if isinstance(v, keras.Variable)]


def restore_rnn_states(layer: keras.layers.Layer, arrays: list[np.ndarray], where: str) -> None:
    """Assign stored states to a stateful RNN's state variables, refusing any mismatch."""
    what = f"{where}: the stored states of stateful RNN layer {layer.name!r}"
    assign_exact(rnn_states(layer), arrays, what, " (another batch size?)")


def rnn_state_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """``(label, value)`` of every stateful RNN state of the model, layers in the order
    both sides agree on: for a backend whose weights Keras's ``save_weights`` stores, which
    skips them."""
    return [
        (f"{layer.name}/state_{i}", np.asarray(keras.ops.convert_to_numpy(variable)))
        for layer in stateful_layers(model)
        for i, variable in enumerate(rnn_states(layer))
    ]


def restore_rnn_state_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    """Give back what :func:`rnn_state_arrays` stored, refusing any count mismatch."""
    layers = [layer for layer in stateful_layers(model) if rnn_states(layer)]
    counts = [len(rnn_states(layer)) for layer in layers]
    for layer, states in _per_layer(layers, counts, arrays, f"{where}: stateful RNN states"):
        restore_rnn_states(layer, states, where)


def lora_variable_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """``(label, value)`` of every variable of every LoRA layer, layers in the order both
    sides agree on: for a backend whose weights Keras's ``save_weights`` stores, which
    merges the adapters away (``merges_lora_when_saved``)."""
    return [
        (f"{layer.name}/{i}", np.asarray(keras.ops.convert_to_numpy(variable)))
        for layer in stateful_layers(model)
        if merges_lora_when_saved(layer)
        for i, variable in enumerate(layer.variables)
    ]


def restore_lora_variable_arrays(
    model: keras.Model, arrays: list[np.ndarray] | None, where: str
) -> None:
    """Give back what :func:`lora_variable_arrays` stored; ``None`` (nothing stored: an
    older checkpoint) is refused when the model has LoRA layers."""
    layers = [layer for layer in stateful_layers(model) if merges_lora_when_saved(layer)]
    if arrays is None:
        if layers:
            raise merged_lora_error(layers[0], f"no LoRA variables stored in {where}")
        return
    counts = [len(layer.variables) for layer in layers]
    for layer, values in _per_layer(layers, counts, arrays, f"{where}: LoRA layers' variables"):
        what = f"{where}: the stored variables of LoRA layer {layer.name!r}"
        assign_exact(layer.variables, values, what)


def own_state_pairs(
    source: keras.Model, target: keras.Model
) -> list[tuple[keras.layers.Layer, keras.layers.Layer]]:
    """The (layer of ``source``, its counterpart in ``target``) pairs whose state a copy
    of the variables does not carry (``keeps_own_state``), for ``copy_own_state``: the
    same for as long as the two models' layers are (an async save copies every epoch)."""
    pairs = zip(stateful_layers(source), stateful_layers(target), strict=True)
    return [(mine, theirs) for mine, theirs in pairs if keeps_own_state(mine)]


def copy_own_state(
    source: keras.Model,
    target: keras.Model,
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] | None = None,
) -> None:
    """Give each layer of ``target`` (the same architecture) the state its counterpart in
    ``source`` keeps its own way, through the protocol, as a save and load would. Plain
    layers are skipped: their variables are copied directly by the caller. ``pairs``:
    ``own_state_pairs(source, target)`` if the caller kept it."""
    for mine, theirs in own_state_pairs(source, target) if pairs is None else pairs:
        restore_one(theirs, collect_one(mine))  # the same path as a save and a load


def write_assets(model: keras.Model, directory: Path) -> None:
    """Every layer's ``save_assets`` files under ``directory/NNNNN/`` (NNNNN: the layer's
    position); for a backend whose variables Keras's own ``save_weights`` already stores
    through ``save_own_variables``, which carries no assets."""
    for index, layer in enumerate(stateful_layers(model)):
        if hasattr(layer, "save_assets"):
            target = directory / f"{index:05d}"
            target.mkdir(parents=True)
            _call(layer, "save_assets", str(target), saving=True)


def read_assets(model: keras.Model, directory: Path, where: str) -> None:
    """Give every layer with ``load_assets`` its files written by :func:`write_assets`."""
    for index, layer in enumerate(stateful_layers(model)):
        if not hasattr(layer, "load_assets"):
            continue
        source = directory / f"{index:05d}"
        if hasattr(layer, "save_assets") and not source.is_dir():
            raise CorruptCheckpointError(
                f"{where}: the asset files of layer {layer.name!r} ({type(layer).__name__}) "
                f"are missing; the checkpoint is damaged or was written by a different "
                f"architecture. Received: no {source.name}/ in {directory}"
            )
        with tempfile.TemporaryDirectory(prefix="trainer-assets-") as scratch:
            if source.is_dir():
                _write_tree(Path(scratch), _read_tree(source))
            _call(layer, "load_assets", scratch, saving=False)


def keeps_own_state(layer: keras.layers.Layer, *, assets_only: bool = False) -> bool:
    """True if ``layer`` keeps state that variables copied by position would not restore:
    it has assets, or (unless ``assets_only``) loads its variables its own way."""
    if hasattr(layer, "load_assets"):
        return True
    if assets_only:
        return False
    return bool(rnn_states(layer)) or not loads_own_variables_by_position(layer)


def refuse_older_format(model: keras.Model, where: object, *, assets_only: bool) -> None:
    """Checkpoints written before this protocol was honoured stored variables only (by
    position, or without assets): correct for plain layers, silently wrong for a layer
    that keeps state its own way. Refuse those instead of loading them wrong."""
    special = [
        f"{layer.name!r} ({type(layer).__name__})"
        for layer in stateful_layers(model)
        if keeps_own_state(layer, assets_only=assets_only)
    ]
    if special:
        raise IncompatibleFormatError(
            f"{where} was written by an older trainer that stored only variables, which "
            f"cannot restore the state these layers keep their own way: "
            f"{', '.join(special[:5])}. Load it with the trainer version that wrote it and "
            f"save it again, or retrain. Received: format_version 1"
        )


PROTOCOL = ("save_own_variables", "load_own_variables", "save_assets", "load_assets")


def failing_layer(error: BaseException) -> tuple[keras.layers.Layer, str] | None:
    """The layer (and protocol method) in whose hook ``error`` was raised, when Keras's own
    saving code called the hook for us (``save_weights`` / ``load_weights``)."""
    found = None
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name in PROTOCOL and isinstance(owner, keras.layers.Layer):
            found = owner, frame.f_code.co_name  # the innermost one wins
        traceback = traceback.tb_next
    return found


def hook_failure(
    layer: keras.layers.Layer, method: str, error: BaseException, *, saving: bool
) -> LayerStateError:
    """The error to raise, ``from error``, when ``layer``'s own ``method`` raised ``error``:
    it names the layer's code, never the checkpoint, and carries the original's text (the
    original itself rides along as ``__cause__``)."""
    what = (
        "Fix that method of the layer, or the state it keeps"
        if saving
        else "Either the method has a bug, or the state stored for this layer does not "
        "fit the layer as it is now built (another version of its class?)"
    )
    return LayerStateError(
        f"Layer {layer.name!r} ({type(layer).__name__}) failed in its own {method}() "
        f"while {'saving' if saving else 'loading'} a checkpoint. {what}. "
        f"Received error: {type(error).__name__}: {error}"
    )


def _call(layer: keras.layers.Layer, method: str, argument: object, *, saving: bool) -> None:
    try:
        getattr(layer, method)(argument)
    except Exception as error:  # the layer's own code: named as such, never "damaged"
        raise hook_failure(layer, method, error, saving=saving) from error


def _read_tree(root: Path) -> dict[str, bytes]:
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for relative, content in files.items():
        target = (root / relative).resolve()
        if root.resolve() not in target.parents:  # stored names are untrusted
            raise CorruptCheckpointError(
                f"An asset file name in the checkpoint leaves its directory; the checkpoint "
                f"is damaged or crafted. Received: {relative!r}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
