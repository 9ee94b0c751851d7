"""Pieces the ``h5`` and ``weights`` backends share: the architecture as JSON, rebuilding a
model from it without running stored code, and lists of arrays in an HDF5 group.

Arrays are stored by position (``00000``, ``00001``...) with the variable path only as a
label, because Keras names variables differently in the process that loads them.
"""

from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import h5py
import keras
import ml_dtypes
import numpy as np

from trainer import limits
from trainer.errors import (
    CorruptCheckpointError,
    MissingClassError,
    ModelNotReadyError,
    SaveError,
    UnsafeCheckpointError,
)
from trainer.state import TrainingState

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def has_hdf5_signature(path: Path) -> bool:
    """True if ``path`` is an HDF5 file: the signature at offset 0, or after a user block
    of 512 or 1024 bytes (the ``h5`` backend keeps its manifest in a 512-byte one)."""
    try:
        with open(path, "rb") as handle:
            for offset in (0, 512, 1024):
                handle.seek(offset)
                if handle.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                    return True
    except OSError:
        return False
    return False


def write_file(path: Path, *chunks: bytes | memoryview) -> None:
    """Write ``chunks`` with plain Python I/O.

    HDF5 content is built in memory (``h5py.File(io.BytesIO())``) and written here because
    h5py crashes the whole process (SIGSEGV while closing) when the HDF5 library's own
    write fails with ENOSPC or EFBIG; Python's write raises a clean OSError instead.
    """
    with open(path, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)


def keras_weights_bytes(model: keras.Model) -> memoryview:
    """What ``model.save_weights("x.weights.h5")`` writes, built in memory (same layout,
    same Keras code: its ``H5IOStore`` accepts a BytesIO)."""
    from keras.src.saving import saving_lib

    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    try:
        saving_lib._save_state(
            model,
            weights_store=store,
            assets_store=None,
            inner_path="",
            visited_saveables=set(),
        )
    finally:
        store.close()
    return buffer.getbuffer()


def model_config(model: keras.Model) -> dict[str, Any]:
    """The model's architecture (with build and compile config) as a JSON-able dict."""
    try:
        config = keras.saving.serialize_keras_object(model)
        json.dumps(config)
    except (NotImplementedError, TypeError, ValueError) as error:
        raise ModelNotReadyError(
            f"Model {model.name!r} cannot be described as a config, so it could not be "
            f"rebuilt on load. Give custom layers and models a get_config() returning their "
            f"constructor arguments, and register them with "
            f"@keras.saving.register_keras_serializable(). Received error: {error}"
        ) from error
    return config


def to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise SaveError(
            f"The {what} to store in the checkpoint is not JSON-serializable; pass plain "
            f"dicts, lists, strings and numbers (convert OmegaConf configs with "
            f"OmegaConf.to_container). Received error: {error}"
        ) from error


def from_json(text: str, what: str, where: Path) -> Any:
    """Parse a stored JSON document, bounded in size and nesting (``trainer.limits``)."""
    limits.check_text_size(len(text), what, where)
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{where}: the stored {what} is not valid JSON; the checkpoint is damaged. "
            f"Load an older checkpoint. Received error: {type(error).__name__}: {error}"
        ) from error
    limits.check_structure(value, what, where, dimensions=False)
    return value


def parse_state(text: str, where: Path) -> TrainingState:
    from trainer.save_backends.base import checkpoint_state

    return checkpoint_state(from_json(text, "training state", where), where)


def rebuild_model(
    config: dict[str, Any],
    compile_config: dict[str, Any] | None,
    *,
    custom_objects: dict[str, Any],
    safe_mode: bool,
    compile: bool,
    where: Path,
) -> keras.Model:
    """Deserialize the architecture, build it, and compile it as saved (if ``compile``)."""
    if not isinstance(config, dict) or not (
        compile_config is None or isinstance(compile_config, dict)
    ):
        raise CorruptCheckpointError(
            f"{where}: the stored architecture and compile config must be JSON objects; the "
            f"checkpoint is damaged. Load an older checkpoint. Received "
            f"{type(config).__name__} and {type(compile_config).__name__}"
        )
    limits.check_structure(config, "architecture", where, dimensions=True)
    config = {k: v for k, v in config.items() if k != "compile_config"}
    model = _deserialize(config, custom_objects, safe_mode, where, "model")
    if not isinstance(model, keras.Model) or not model.built:
        raise CorruptCheckpointError(
            f"{where}: the stored architecture did not rebuild into a built Keras model "
            f"(no build config?). Re-save the checkpoint from a built model. "
            f"Received: {type(model).__name__}, built={getattr(model, 'built', None)}"
        )
    if compile and compile_config:
        compile_model(
            model, compile_config, custom_objects=custom_objects, safe_mode=safe_mode, where=where
        )
    return model


def compile_model(
    model: keras.Model,
    compile_config: dict[str, Any],
    *,
    custom_objects: dict[str, Any],
    safe_mode: bool,
    where: Path,
) -> None:
    """``model.compile`` with the stored arguments under ``safe_mode``; builds the optimizer."""
    kwargs = _deserialize(compile_config, custom_objects, safe_mode, where, "compile config")
    with keras.saving.custom_object_scope(custom_objects):  # names compile() looks up itself
        model.compile(**kwargs)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _deserialize(config, custom_objects, safe_mode, where, what):
    try:
        return keras.saving.deserialize_keras_object(  # Keras pops from what it is given
            copy.deepcopy(config), custom_objects=custom_objects, safe_mode=safe_mode
        )
    except (TypeError, ValueError) as error:
        message = str(error)
        missing = re.search(r"Could not locate (?:class|function) '([^']+)'", message)
        if missing:
            name = _registered_name(config, missing.group(1))
            raise MissingClassError(
                f"{where}: the stored {what} uses {name!r}, which is not registered in this "
                f"process. Import the module that defines it (decorated with "
                f"@keras.saving.register_keras_serializable) before loading, or pass "
                f"custom_objects={{{name!r}: cls}}. Received: missing {name!r}"
            ) from error
        if "lambda" in message:
            raise UnsafeCheckpointError(
                f"{where}: the stored {what} holds a Python lambda, which would run code "
                f"from the checkpoint. If you trust its source, load with safe_mode=False. "
                f"Received error: {message.splitlines()[0]}"
            ) from error
        raise CorruptCheckpointError(
            f"{where}: the stored {what} could not be deserialized; the checkpoint is "
            f"damaged or was written with incompatible classes. Received error: {message}"
        ) from error


def _registered_name(config: Any, class_name: str) -> str:
    """The ``package>Name`` Keras looks ``class_name`` up by, found in the stored config."""
    if isinstance(config, dict):
        if config.get("class_name") == class_name and config.get("registered_name"):
            return config["registered_name"]
        children = config.values()
    elif isinstance(config, list):
        children = config
    else:
        return class_name
    for child in children:
        found = _registered_name(child, class_name)
        if found != class_name:
            return found
    return class_name


def write_arrays(
    parent: h5py.Group,
    name: str,
    pairs: list[tuple[str, np.ndarray]],
    compression: str | None = None,
) -> None:
    """Store ``(path, array)`` pairs in order as datasets of a new group ``name``."""
    group = parent.create_group(name)
    group.attrs["count"] = len(pairs)
    for index, (var_path, value) in enumerate(pairs):
        options = {"compression": compression} if compression and value.ndim else {}
        dataset = group.create_dataset(f"{index:05d}", data=value, **options)
        dataset.attrs["path"] = var_path
        dataset.attrs["dtype"] = str(value.dtype)  # h5py keeps bfloat16 & co. as opaque bytes


def read_arrays(parent: h5py.Group, name: str, where: Path) -> list[np.ndarray]:
    """The arrays of group ``name`` in stored order; checks none is missing."""
    if name not in parent:
        raise CorruptCheckpointError(
            f"{where}: group {name!r} is missing; the checkpoint is damaged. "
            f"Received groups: {sorted(parent)}"
        )
    group = parent[name]
    count = int(group.attrs.get("count", -1))
    keys = sorted(group)
    if count != len(keys) or keys != [f"{i:05d}" for i in range(count)]:
        raise CorruptCheckpointError(
            f"{where}: group {name!r} should hold {count} arrays numbered from 00000 but "
            f"holds {len(keys)}; the checkpoint is damaged. Received keys: {keys[:5]}..."
        )
    return [_typed(group[key]) for key in keys]


def _typed(dataset: h5py.Dataset) -> np.ndarray:
    value = np.asarray(dataset[()])
    if value.dtype.kind == "V":  # an ml_dtypes type (bfloat16, float8...) stored as bytes
        value = value.view(getattr(ml_dtypes, str(dataset.attrs.get("dtype"))))
    return value


def write_text(parent: h5py.Group, name: str, text: str) -> None:
    parent.create_dataset(name, data=text, dtype=h5py.string_dtype("utf-8"))


def read_text(parent: h5py.Group, name: str, where: Path) -> str:
    if name not in parent:
        raise CorruptCheckpointError(
            f"{where}: entry {name!r} is missing; the checkpoint is damaged. "
            f"Received entries: {sorted(parent)}"
        )
    return parent[name].asstr()[()]
