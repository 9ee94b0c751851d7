"""The state layers keep their own way, in a trainer SavedModel.

Variables live in the SavedModel's ``variables/`` checkpoint, and revival points each Keras
variable at that storage; but a layer that keeps state its own way (``save_own_variables``
/ ``load_own_variables`` / ``save_assets`` / ``load_assets``: adapted ``Normalization``,
lookup vocabularies, a custom layer's NumPy state) needs its own methods to run on load.
Those layers' states are stored in ``assets.extra/trainer_layer_state.h5`` (a file TF and
TF Serving ignore), by their position in the object graph, and restored through the
protocol into every layer that was rebuilt from its class. A layer revived from traced
functions (class missing) behaves as traced, state included, and needs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import keras

from trainer.errors import LayerStateError
from trainer.model_state import layer_protocol
from trainer.save_backends import hdf5_arrays
from trainer.save_backends.savedmodel import layout
from trainer.save_backends.savedmodel.features import standins

LAYER_STATE_FILE = "trainer_layer_state.h5"


def state_path(directory: Path) -> Path:
    return directory / layout.METADATA_DIR / LAYER_STATE_FILE


def write(model: keras.Model, directory: Path) -> None:
    """Store the state of every layer that keeps some its own way (nothing if none)."""
    layers = layer_protocol.stateful_layers(model)
    own = [(i, layer) for i, layer in enumerate(layers) if layer_protocol.keeps_own_state(layer)]
    if not own:
        return
    states = [layer_protocol.collect_one(layer) for _, layer in own]
    target = state_path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(target, "w") as handle:
        handle.create_dataset("indices", data=[i for i, _ in own])
        hdf5_arrays.write_layer_states(handle, "layers", states)


def restore(
    model: keras.Model,
    revived: dict[int, keras.layers.Layer],
    records: list[dict[str, Any]],
    where: Path,
) -> None:
    """Run the protocol on every layer rebuilt from its class whose state was stored."""
    source = state_path(where)
    if not source.is_file():
        return
    with h5py.File(source, "r") as handle:
        indices = [int(i) for i in handle["indices"][()]]
        states = hdf5_arrays.read_layer_states(handle, "layers", source)
    by_index = _layers_by_index(model, revived, records)
    traced = _under_stand_ins(revived, records)
    for index, state in zip(indices, states, strict=True):
        layer = by_index.get(index)
        if index in traced:
            continue  # behaves as traced: its state is in the traced functions
        if layer is not None and not layer_protocol.keeps_own_state(layer):
            # Restored exactly by its variables (a LoRA layer: older trainers stored it
            # here the merging way too, and running that would zero its adapters).
            continue
        if layer is None:
            raise LayerStateError(
                f"{where}: layer {state.name!r} ({state.class_name}) keeps state of its own, "
                f"but it could not be found in the revived model to restore it. Load with "
                f"its class importable. Received: layer #{index}"
            )
        layer_protocol.restore_one(layer, state)


def _layers_by_index(
    model: keras.Model, revived: dict[int, keras.layers.Layer], records: list[dict[str, Any]]
) -> dict[int, keras.layers.Layer]:
    """Object-graph position -> layer of the revived model: by walking it when its layers
    match the records one to one (everything rebuilt from config), else what the reviver
    revived itself."""
    walk = layer_protocol.stateful_layers(model)
    names = [record.get("class_name") for record in records]
    if len(walk) == len(records) and [type(x).__name__ for x in walk] == names:
        return dict(enumerate(walk))
    return dict(revived)


def _under_stand_ins(
    revived: dict[int, keras.layers.Layer], records: list[dict[str, Any]]
) -> set[int]:
    """Positions of stand-ins (revived from traced functions) and of all their sublayers."""
    stand_in_types = (standins.RevivedLayer, standins.RevivedModel)
    pending = [i for i, layer in revived.items() if isinstance(layer, stand_in_types)]
    found: set[int] = set()
    while pending:
        index = pending.pop()
        if index not in found:
            found.add(index)
            pending.extend(child["id"] for child in records[index].get("sublayers", []))
    return found
