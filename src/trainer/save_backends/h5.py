"""``h5``: the whole checkpoint in one HDF5 file, written with h5py.

Keras 3's own legacy ``.h5`` format cannot reload a model compiled with string losses
(``compile("adam", "mse")`` fails with "Could not deserialize 'keras.metrics.mse'") and
drops the RNG seed states, so we store Keras 3 configs instead::

    /                 attrs: format="trainer-h5", format_version
    /model_config     JSON of keras.saving.serialize_keras_object(model), plus the
                      model's dtype policy (save_backends.policies)
    /compile_config   JSON of model.get_compile_config() ("null" if not compiled)
    /training_state   JSON of TrainingState
    /layers/NNNNN/    one group per layer (the model, then every sublayer, in Keras's
                      tracking order): arrays/ from its save_own_variables (attr "path"
                      is the store key; a stateful RNN's states under "trainer:rnn_state:N"),
                      assets/ its save_assets files as bytes
    /rng_state/       Dropout & co. seed states (model.variables minus model.weights)
    /optimizer/       every optimizer variable: iteration, learning rate, all slots
    /metadata         JSON, written last: the completeness mark can_load looks for

The first 512 bytes are an HDF5 user block (skipped by every HDF5 reader) holding the
manifest: the file size and the SHA-256 of the bytes after the block (trainer.storage.integrity).
"""

from __future__ import annotations

import functools
import io as stdio
from pathlib import Path
from typing import Any, ClassVar

import h5py
import keras

from trainer.errors import TrainerError
from trainer.model_state import kit, layer_protocol
from trainer.save_backends import hdf5_arrays
from trainer.save_backends.base import LoadedCheckpoint, SaveBackend
from trainer.state import TrainingState
from trainer.storage import integrity

FORMAT = "trainer-h5"


class H5Backend(SaveBackend):
    """One self-contained ``.h5`` file: architecture, weights, optimizer, compile, state."""

    name: ClassVar[str] = "h5"
    # 2: per-layer state (save_own_variables / save_assets) instead of model.weights by
    # position, which lost adapted preprocessing state. Version 1 files still load when no
    # layer of the model keeps such state (see _read).
    format_version: ClassVar[int] = 2
    is_directory: ClassVar[bool] = False
    suffix: ClassVar[str] = ".h5"

    def __init__(self, compression: str | None = None):
        # "gzip" trades save time for size; weights rarely compress much, so off by default.
        self.compression = compression

    @classmethod
    def can_load(cls, path: Path) -> bool:
        """A file whose user block holds trainer's manifest is ours without HDF5 parsing
        it: libhdf5 can spin forever on damaged metadata (the corruption fuzzer hung on a
        damaged global heap), so nothing of a sealed file is parsed before its digest is
        checked (``load``, ``read_metadata``). Files without the seal are opened."""
        path = Path(path)
        if not path.is_file() or not hdf5_arrays.has_hdf5_signature(path):
            return False
        try:
            if integrity.read_hdf5_seal(path) is not None:
                return True
        except (OSError, TrainerError):
            return False
        try:
            with h5py.File(path, "r") as handle:
                return handle.attrs.get("format") == FORMAT and "metadata" in handle
        except (OSError, ValueError):
            return False

    @classmethod
    def read_metadata(cls, path: Path) -> dict[str, Any]:
        """The stored metadata; the whole file's digest is checked first (see ``can_load``)."""
        integrity.verify_hdf5(path, digests=True)
        with h5py.File(path, "r") as handle:
            return kit.from_json(hdf5_arrays.read_text(handle, "metadata", path), "metadata", path)

    def _write(
        self, model: keras.Model, tmp: Path, state: TrainingState, metadata: dict[str, Any]
    ) -> None:
        config = kit.to_json(kit.model_config(model), "model config")
        compile_config = kit.to_json(kit.compile_config(model), "compile config")
        metadata_text = kit.to_json(metadata, "metadata")
        # Built in memory and written with Python I/O: see hdf5_arrays.write_file (h5py segfaults
        # on a full disk). The user block in front holds the manifest (size + SHA-256).
        buffer = stdio.BytesIO()
        with h5py.File(buffer, "w", userblock_size=integrity.HDF5_USERBLOCK) as handle:
            handle.attrs["format"] = FORMAT
            handle.attrs["format_version"] = self.format_version
            hdf5_arrays.write_text(handle, "model_config", config)
            hdf5_arrays.write_text(handle, "compile_config", compile_config)
            hdf5_arrays.write_text(handle, "training_state", state.to_json())
            write = functools.partial(
                hdf5_arrays.write_arrays, handle, compression=self.compression
            )
            states = layer_protocol.collect(model)
            hdf5_arrays.write_layer_states(handle, "layers", states, self.compression)
            write("rng_state", kit.rng_state_arrays(model))
            write("optimizer", kit.optimizer_arrays(model))
            hdf5_arrays.write_text(handle, "metadata", metadata_text)
        data = buffer.getbuffer()
        hdf5_arrays.write_file(tmp, integrity.seal_hdf5(data), data[integrity.HDF5_USERBLOCK :])

    def integrity_record(self) -> dict[str, Any]:
        return {"manifest": integrity.HDF5_LOCATION, "algorithm": integrity.ALGORITHM}

    def check_integrity(
        self, path: Path, *, digests: bool, strict: bool = False
    ) -> dict[str, Any] | None:
        """The manifest is the user block: file size always, digest of the rest if asked."""
        return integrity.verify_hdf5(path, digests=digests)

    def _read(
        self,
        path: Path,
        *,
        custom_objects: dict[str, Any],
        compile: bool,
        safe_mode: bool = True,
    ) -> LoadedCheckpoint:
        """Rebuild from the stored config; ``safe_mode=False`` allows stored lambdas."""
        with h5py.File(path, "r") as handle:
            metadata = kit.from_json(
                hdf5_arrays.read_text(handle, "metadata", path), "metadata", path
            )
            self.check_format_version(metadata, path)
            config = kit.from_json(
                hdf5_arrays.read_text(handle, "model_config", path), "config", path
            )
            compile_config = kit.from_json(
                hdf5_arrays.read_text(handle, "compile_config", path), "compile config", path
            )
            state = kit.parse_state(hdf5_arrays.read_text(handle, "training_state", path), path)
            version = metadata.get("format_version")
            if version == 1:  # positional model.weights
                weights = hdf5_arrays.read_arrays(handle, "model_weights", path)
            else:
                layers = hdf5_arrays.read_layer_states(handle, "layers", path)
            rng = hdf5_arrays.read_arrays(handle, "rng_state", path)
            optimizer = hdf5_arrays.read_arrays(handle, "optimizer", path) if compile else []
        model = kit.rebuild_model(
            config,
            compile_config,
            custom_objects=custom_objects,
            safe_mode=safe_mode,
            compile=compile,
            where=path,
        )
        if version == 1:
            layer_protocol.refuse_older_format(model, path, assets_only=False)
            kit.restore_model_weight_arrays(model, weights, str(path))
        else:
            layer_protocol.restore(model, layers, str(path))
        kit.restore_rng_state_arrays(model, rng, str(path))
        if compile:
            kit.restore_optimizer_arrays(model, optimizer, str(path))
        return LoadedCheckpoint(model=model, state=state, metadata=metadata, path=path)
