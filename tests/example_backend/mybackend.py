"""A complete custom save backend: one ``.npz`` holding the architecture config, weights,
RNG seed states, optimizer variables and training state.

It is read with ``allow_pickle=False`` and rebuilt with Keras' safe deserialization, so a
checkpoint cannot run code unless the caller loads it with ``safe_mode=False``. Use it without
registering anything (``mybackend`` importable):

    python train.py save._target_=mybackend.NpzBackend

or give it a short name: ``trainer.save_backends.register_backend("npz", "mybackend:NpzBackend")``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import keras
import numpy as np

from trainer.model_state import kit
from trainer.save_backends import LoadedCheckpoint, SaveBackend
from trainer.state import TrainingState

HEADER = "npz_backend_header"  # JSON string array; its presence marks our format


class NpzBackend(SaveBackend):
    name = "npz"
    is_directory = False  # SaveBackend.save writes a temporary file and renames it
    suffix = ".npz"

    @classmethod
    def can_load(cls, path: Path) -> bool:
        try:
            with zipfile.ZipFile(path) as archive:
                return f"{HEADER}.npy" in archive.namelist()
        except (OSError, zipfile.BadZipFile):
            return False

    def _write(self, model, tmp, state, metadata):
        header = {
            "config": keras.saving.serialize_keras_object(model),
            "compile": kit.compile_config(model),
            "state": state.to_dict(),
            "metadata": metadata,
        }
        arrays = {HEADER: np.array(json.dumps(header))}
        for prefix, pairs in (
            ("w", kit.model_weight_arrays(model)),
            ("r", kit.rng_state_arrays(model)),  # Dropout seeds: exact resume
            ("o", kit.optimizer_arrays(model)),  # iteration count and every slot
        ):
            arrays.update({f"{prefix}{i:05d}": value for i, (_, value) in enumerate(pairs)})
        with open(tmp, "wb") as handle:  # a file object: np.savez would append ".npz"
            np.savez(handle, **arrays)

    def _read(self, path, *, custom_objects, compile, safe_mode=True):
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(str(data[HEADER]))
            stored = {p: [data[k] for k in sorted(data.files) if k[0] == p] for p in "wro"}
        config = {k: v for k, v in header["config"].items() if k != "compile_config"}
        model = keras.saving.deserialize_keras_object(
            config, custom_objects=custom_objects, safe_mode=safe_mode
        )
        kit.restore_model_weight_arrays(model, stored["w"], str(path))
        kit.restore_rng_state_arrays(model, stored["r"], str(path))
        if compile:
            kit.compile_model(
                model,
                header["compile"],
                custom_objects=custom_objects,
                safe_mode=safe_mode,
                where=path,
            )
            kit.restore_optimizer_arrays(model, stored["o"], str(path))
        state = TrainingState.from_dict(header["state"])
        return LoadedCheckpoint(model=model, state=state, metadata=header["metadata"], path=path)
