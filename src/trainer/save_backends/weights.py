"""``weights``: Keras 3's own ``model.weights.h5`` plus what trainer needs beside it::

    model.weights.h5   model.save_weights(): every layer weight, readable by plain Keras
    optimizer.h5       optimizer variables (iteration, learning rate, every slot), the
                       RNG seed states of Dropout & co. and the states of stateful RNNs,
                       which save_weights skips
    assets/NNNNN/      each layer's save_assets files (NNNNN: its position among the model
                       and its sublayers), e.g. an adapted StringLookup's vocabulary
    trainer.json       format marker, architecture config, compile config, training state
                       and metadata; written last, so it marks the directory complete
    trainer_manifest.json  size and SHA-256 of every file above (trainer.storage.integrity)

Keras 3.15's ``.weights.h5`` also carries the optimizer variables, but restores them only
into an optimizer that is already built and skips them with a mere warning when the count
differs; ``optimizer.h5`` is our checked copy, restored by position with count and shape
checks, and it is the one that counts. It is HDF5 rather than ``.npz`` because h5py is
already required, the format cannot hold pickles (``.npz`` is safe only while every reader
remembers ``allow_pickle=False``), and each array keeps its variable path as an attribute.

``load(path)`` rebuilds the architecture from ``trainer.json``. ``load(path, model=m)``
loads into an existing model of the same architecture instead (built from the stored build
config if it is not built yet); with ``compile=True`` it is recompiled as saved and its
optimizer restored, with ``compile=False`` its own compile is kept (Keras may still copy
the saved slots into its optimizer if that is built and has the same variable count).
"""

from __future__ import annotations

import contextlib
import io as stdio
import json
from pathlib import Path
from typing import Any, ClassVar

import h5py
import keras

from trainer._compat import live_objects
from trainer.errors import ConfigMismatchError, LayerStateError
from trainer.model_state import kit, layer_protocol
from trainer.model_state.readiness import check_model_ready
from trainer.save_backends import hdf5_arrays
from trainer.save_backends.base import LoadedCheckpoint, SaveBackend
from trainer.state import TrainingState
from trainer.storage import integrity

FORMAT = "trainer-weights"
WEIGHTS_FILE = "model.weights.h5"
EXTRA_FILE = "optimizer.h5"
INDEX_FILE = "trainer.json"
ASSETS_DIR = "assets"
RNN_STATES = "rnn_states"  # in EXTRA_FILE: stateful RNN states, which save_weights skips
LORA_VARIABLES = "lora_variables"  # in EXTRA_FILE: LoRA layers' variables as they are


class WeightsBackend(SaveBackend):
    """A directory with Keras' ``model.weights.h5``, optimizer state and a JSON index."""

    name: ClassVar[str] = "weights"
    # 2: assets/ holds each layer's save_assets files (adapted lookup vocabularies), which
    # Keras's .weights.h5 does not carry. Version 1 loads when no layer has assets.
    format_version: ClassVar[int] = 2
    is_directory: ClassVar[bool] = True
    async_by_default: ClassVar[bool] = True
    # Values are read after the model is rebuilt from trainer.json (``_read``).
    read_late: ClassVar[tuple[str, ...]] = (WEIGHTS_FILE, EXTRA_FILE)

    @classmethod
    def can_load(cls, path: Path) -> bool:
        path = Path(path)
        if not (path / WEIGHTS_FILE).is_file() or not (path / EXTRA_FILE).is_file():
            return False
        try:
            index = json.loads((path / INDEX_FILE).read_text())
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(index, dict) and index.get("format") == FORMAT and "metadata" in index

    @classmethod
    def read_metadata(cls, path: Path) -> dict[str, Any]:
        return json.loads((Path(path) / INDEX_FILE).read_text())["metadata"]

    def _write(
        self, model: keras.Model, tmp: Path, state: TrainingState, metadata: dict[str, Any]
    ) -> None:
        index = {
            "format": FORMAT,
            "format_version": self.format_version,
            "model_config": kit.model_config(model),
            "compile_config": kit.compile_config(model),
            "training_state": state.to_dict(),
            "metadata": metadata,
        }
        index_text = kit.to_json(index, "index (config, state and metadata)")
        # HDF5 built in memory, written with Python I/O: h5py segfaults on a full disk.
        hdf5_arrays.write_file(tmp / WEIGHTS_FILE, _keras_weights(model))
        buffer = stdio.BytesIO()
        with h5py.File(buffer, "w") as handle:
            hdf5_arrays.write_arrays(handle, "optimizer", kit.optimizer_arrays(model))
            hdf5_arrays.write_arrays(handle, "rng_state", kit.rng_state_arrays(model))
            hdf5_arrays.write_arrays(handle, RNN_STATES, layer_protocol.rnn_state_arrays(model))
            lora = layer_protocol.lora_variable_arrays(model)  # Keras's file merges them away
            if lora:
                hdf5_arrays.write_arrays(handle, LORA_VARIABLES, lora)
        hdf5_arrays.write_file(tmp / EXTRA_FILE, buffer.getbuffer())
        layer_protocol.write_assets(model, tmp / ASSETS_DIR)  # e.g. adapted lookup vocabularies
        (tmp / INDEX_FILE).write_text(index_text)

    def _read(
        self,
        path: Path,
        *,
        custom_objects: dict[str, Any],
        compile: bool,
        safe_mode: bool = True,
        model: keras.Model | None = None,
    ) -> LoadedCheckpoint:
        """Rebuild (or fill ``model``); ``safe_mode=False`` allows stored lambdas."""
        index = kit.from_json((path / INDEX_FILE).read_text(), "index", path / INDEX_FILE)
        metadata = index.get("metadata")
        self.check_format_version(index, path)
        state = kit.parse_state(json.dumps(index.get("training_state")), path)
        compile_config = index.get("compile_config")
        given = model is not None
        if model is None:
            model = kit.rebuild_model(
                index.get("model_config") or {},
                compile_config,
                custom_objects=custom_objects,
                safe_mode=safe_mode,
                compile=compile,
                where=path,
            )
        else:
            _prepare_existing(model, index.get("model_config") or {}, path)
            if compile and compile_config:
                kit.compile_model(
                    model,
                    compile_config,
                    custom_objects=custom_objects,
                    safe_mode=safe_mode,
                    where=path,
                )
        integrity.await_digests()  # the weights' digests, checked while the model was built
        _load_weights(model, path, given=given)
        if index["format_version"] >= 2:
            layer_protocol.read_assets(model, path / ASSETS_DIR, str(path))
        else:
            layer_protocol.refuse_older_format(model, path, assets_only=True)
        with h5py.File(path / EXTRA_FILE, "r") as handle:
            rng = hdf5_arrays.read_arrays(handle, "rng_state", path / EXTRA_FILE)
            optimizer = (
                hdf5_arrays.read_arrays(handle, "optimizer", path / EXTRA_FILE) if compile else []
            )
            states = None  # absent: written before trainer kept them (they start at zero)
            if RNN_STATES in handle:
                states = hdf5_arrays.read_arrays(handle, RNN_STATES, path / EXTRA_FILE)
            lora = None  # absent: no LoRA layer, or written before trainer kept them
            if LORA_VARIABLES in handle:
                lora = hdf5_arrays.read_arrays(handle, LORA_VARIABLES, path / EXTRA_FILE)
        kit.restore_rng_state_arrays(model, rng, str(path / EXTRA_FILE))
        if states is not None:
            layer_protocol.restore_rnn_state_arrays(model, states, str(path / EXTRA_FILE))
        layer_protocol.restore_lora_variable_arrays(model, lora, str(path / EXTRA_FILE))
        if compile and compile_config:
            kit.restore_optimizer_arrays(model, optimizer, str(path / EXTRA_FILE))
        return LoadedCheckpoint(model=model, state=state, metadata=metadata, path=path)


def _prepare_existing(model: keras.Model, config: dict[str, Any], path: Path) -> None:
    """Build a passed-in model from the stored build config if it is not built yet."""
    if not isinstance(model, keras.Model):
        raise ConfigMismatchError(
            f"load(..., model=...) needs a Keras 3 model to load {path} into. "
            f"Received an object of type {type(model).__name__}"
        )
    if not model.built and config.get("build_config"):
        model.build_from_config(config["build_config"])
        model.built = True  # as Keras' own deserialization does; sublayers checked next
    check_model_ready(model)


def _keras_weights(model: keras.Model) -> memoryview:
    """Keras's own ``.weights.h5`` bytes; a layer's ``save_own_variables`` failing in it is
    named as that layer's failure."""
    try:
        return hdf5_arrays.keras_weights_bytes(model)
    except Exception as error:
        culprit = layer_protocol.failing_layer(error)
        if culprit is None:
            raise
        layer, method = culprit
        raise layer_protocol.hook_failure(layer, method, error, saving=True) from error


@contextlib.contextmanager
def _recording_load_failures(model: keras.Model):
    """Yield a dict that receives, per layer whose own ``load_own_variables`` raises inside
    the block, id(layer) -> (layer, the exception), in the order the layers failed.

    Keras's ``load_weights`` catches what each layer's hook raises, tries the failed ones
    again, then raises one ``ValueError`` holding only the text of the last try: the
    original exception, its type and its traceback would be lost to the caller. So for
    the call, each layer's hook is shadowed by an instance attribute that notes the
    exception (the latest try, as Keras reports it) and re-raises it; Keras looks the hook
    up on the instance. The class is never touched and the attributes go away afterwards,
    also when the load fails."""
    failures: dict[int, tuple[keras.layers.Layer, BaseException]] = {}
    restorers: list = []
    for layer in layer_protocol.stateful_layers(model):
        hook = getattr(layer, "load_own_variables", None)
        if hook is None or "load_own_variables" in vars(layer):
            continue

        def recording(store, _layer=layer, _hook=hook):
            try:
                return _hook(store)
            except Exception as error:
                failures[id(_layer)] = (_layer, error)
                raise

        # An untracked instance attribute: a function is no state for Keras's tracking.
        restorers.append(live_objects.patch_method(layer, "load_own_variables", recording))
    try:
        yield failures
    finally:
        while restorers:
            restorers.pop()()


def _load_weights(model: keras.Model, path: Path, *, given: bool) -> None:
    """``model.load_weights``: Keras calls every layer's ``load_own_variables``; the first
    exception one of them raised is the ``__cause__`` of what the caller gets."""
    try:
        with _recording_load_failures(model) as failures:
            model.load_weights(path / WEIGHTS_FILE)
    except ValueError as error:
        layer, original = next(iter(failures.values()), (None, error))
        first = " ".join(str(error).split())[:600]
        if given:  # most likely the caller's model, not the layer's code
            raise ConfigMismatchError(
                f"The weights in {path / WEIGHTS_FILE} do not fit model {model.name!r}: its "
                f"layers differ from the saved architecture. Load without model= to rebuild "
                f"the saved architecture. Received error: {first}"
            ) from original
        if layer is not None:
            raise layer_protocol.hook_failure(
                layer, "load_own_variables", original, saving=False
            ) from original
        raise LayerStateError(
            f"The weights in {path / WEIGHTS_FILE} could not be loaded into the model rebuilt "
            f"from the checkpoint's own architecture: a layer's load_own_variables() failed, "
            f"or the file does not match the architecture (run `python -m trainer verify "
            f"{path}` to rule out damage). Received error: {first}"
        ) from error
