"""Helpers shared by the fault tests: one small checkpoint per backend, and ways to damage
or craft its content behind the manifest's back (``reseal``), as a buggy writer, a bad
copy or an attacker would."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np

from trainer.errors import CorruptCheckpointError
from trainer.save_backends import get_backend
from trainer.state import TrainingState
from trainer.storage.integrity import (
    HDF5_USERBLOCK,
    MANIFEST_FILE,
    find_manifest,
    read_hdf5_seal,
    seal_hdf5,
    write_manifest,
)

BACKENDS = ("h5", "weights", "savedmodel")
FEATURES = 6


def reseal(path: Path) -> None:
    """Rewrite the manifest of a checkpoint edited on purpose, behind the manifest's back,
    so that only the readers' own checks stand between the edit and a load."""
    path = Path(path)
    if path.is_dir():
        found = find_manifest(path)
        relative, manifest = found if found else (MANIFEST_FILE, {})
        info = {k: manifest[k] for k in ("backend", "format_version") if k in manifest}
        write_manifest(path, relative, **info)
        return
    data = path.read_bytes()
    if read_hdf5_seal(path) is None:
        raise CorruptCheckpointError(f"{path} has no HDF5 user-block manifest to rewrite")
    path.write_bytes(seal_hdf5(data) + data[HDF5_USERBLOCK:])


def build_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    hidden = keras.layers.Dropout(0.2, seed=3)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden), name="faulty")
    model.compile("adam", "mse")
    x = np.random.default_rng(0).normal(size=(16, FEATURES)).astype("float32")
    model.fit(x, x[:, :3], batch_size=8, verbose=0)
    return model


def save_all(model: keras.Model, directory: Path) -> dict[str, Path]:
    state = TrainingState(epoch=1, global_step=2)
    return {b: get_backend(b).save(model, directory / b, state=state) for b in BACKENDS}


def copy_checkpoint(source: Path, directory: Path) -> Path:
    target = Path(directory) / source.name
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True)
    else:
        shutil.copy2(source, target)
    return target


# ------------------------------------------------------------------- where things are
def data_file(backend: str, path: Path) -> Path:
    """The file holding the variable values."""
    return {
        "h5": path,
        "weights": path / "model.weights.h5",
        "savedmodel": path / "variables" / "variables.data-00000-of-00001",
    }[backend]


def index_file(backend: str, path: Path) -> Path:
    """The file that says what the checkpoint is and how to read the rest."""
    return {
        "weights": path / "trainer.json",
        "savedmodel": path / "variables" / "variables.index",
    }[backend]


# --------------------------------------------------------------------- crafting JSON
def edit(backend: str, path: Path, part: str, change: Callable[[Any], Any]) -> None:
    """Replace stored JSON ``part`` ("metadata", "architecture", "state") by
    ``change(old)`` and rewrite the manifest so that only the content is wrong."""
    if backend == "h5":
        name = {"metadata": "metadata", "architecture": "model_config", "state": "training_state"}
        with h5py.File(path, "r+") as handle:
            old = json.loads(handle[name[part]].asstr()[()])
            del handle[name[part]]
            text = json.dumps(change(old))
            handle.create_dataset(name[part], data=text, dtype=h5py.string_dtype("utf-8"))
    elif backend == "weights":
        key = {"metadata": "metadata", "architecture": "model_config", "state": "training_state"}
        index = json.loads((path / "trainer.json").read_text())
        index[key[part]] = change(index[key[part]])
        (path / "trainer.json").write_text(json.dumps(index))
    else:
        file = path / "assets.extra" / "trainer_metadata.json"
        meta = json.loads(file.read_text())
        if part == "metadata":
            meta = change(meta)
        elif part == "state":
            meta["state"] = change(meta["state"])
        else:
            meta["savedmodel"]["layers"] = change(meta["savedmodel"]["layers"])
        file.write_text(json.dumps(meta))
    reseal(path)


def edit_layer(backend: str, path: Path, layer: str, change: Callable[[dict], None]) -> None:
    """Apply ``change`` in place to the stored Keras config ({class_name, config, ...}) of
    the layer called ``layer``, wherever the backend keeps it."""

    def apply(doc):
        found = [item for item in _configs(doc) if item["config"].get("name") == layer]
        assert found, f"no layer {layer!r} in the stored architecture"
        for item in found:  # a SavedModel stores it in its record and in the model's config
            change(item)
        return doc

    edit(backend, path, "architecture", apply)


def _configs(doc: Any) -> list[dict]:
    """Every Keras layer config ({class_name, config: {...}}) anywhere in ``doc``."""
    found, stack = [], [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("class_name"), str) and isinstance(item.get("config"), dict):
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def set_record(backend: str, path: Path, layer: str, **fields: Any) -> None:
    """SavedModel only: set fields of the per-layer record (``class_name``...)."""
    assert backend == "savedmodel"

    def apply(records):
        for record in records:
            if record.get("name") == layer:
                record.update(fields)
        return records

    edit(backend, path, "architecture", apply)


def flip_bytes(file: Path, offset_fraction: float = 0.5, count: int = 8) -> None:
    """Invert ``count`` bytes in the middle of ``file``: same size, different content."""
    data = bytearray(file.read_bytes())
    start = int(len(data) * offset_fraction)
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def truncate(file: Path, keep: float = 0.5) -> None:
    with open(file, "r+b") as handle:
        handle.truncate(int(os.path.getsize(file) * keep))
