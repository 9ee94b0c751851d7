"""Lists of arrays and texts in HDF5, for the ``h5`` and ``weights`` backends.

Arrays are stored by position (``00000``, ``00001``...) with the variable path only as a
label, because Keras names variables differently in the process that loads them (see
``trainer.model_state.kit``).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import keras
import ml_dtypes
import numpy as np

from trainer._compat.saving import keras_weights_file_bytes
from trainer.errors import CorruptCheckpointError
from trainer.model_state.layer_protocol import LayerState

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
    same Keras code), so that it can be written with :func:`write_file`."""
    return keras_weights_file_bytes(model)


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


def numbered_group(
    parent: h5py.Group, name: str, what: str, where: Path
) -> list[h5py.Group | h5py.Dataset]:
    """The members of group ``name``, numbered 00000, 00001... up to its ``count``
    attribute; a missing group, member or count is damage, said so."""
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
            f"{where}: group {name!r} should hold {count} {what} numbered from 00000 but "
            f"holds {len(keys)}; the checkpoint is damaged. Received keys: {keys[:5]}..."
        )
    return [group[key] for key in keys]


def read_arrays(parent: h5py.Group, name: str, where: Path) -> list[np.ndarray]:
    """The arrays of group ``name`` in stored order; checks none is missing."""
    return [_typed(member) for member in numbered_group(parent, name, "arrays", where)]


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


def read_labelled_arrays(
    parent: h5py.Group, name: str, where: Path
) -> list[tuple[str, np.ndarray]]:
    """``(label, array)`` pairs of a group written by :func:`write_arrays`, in order."""
    members = numbered_group(parent, name, "arrays", where)
    return [(str(member.attrs.get("path", "")), _typed(member)) for member in members]


def write_layer_states(
    parent: h5py.Group, name: str, states: list[LayerState], compression: str | None = None
) -> None:
    """Every layer's ``save_own_variables`` arrays and asset files, one group per layer."""
    group = parent.create_group(name)
    group.attrs["count"] = len(states)
    for index, state in enumerate(states):
        layer = group.create_group(f"{index:05d}")
        layer.attrs["name"], layer.attrs["class_name"] = state.name, state.class_name
        write_arrays(layer, "arrays", list(state.arrays.items()), compression)
        files = [(p, np.frombuffer(c, dtype=np.uint8)) for p, c in state.assets.items()]
        write_arrays(layer, "assets", files)


def read_layer_states(parent: h5py.Group, name: str, where: Path) -> list[LayerState]:
    """The layer states written by :func:`write_layer_states`, in order."""
    states = []
    for layer in numbered_group(parent, name, "layer states", where):
        state = LayerState(str(layer.attrs.get("name")), str(layer.attrs.get("class_name")))
        state.arrays = dict(read_labelled_arrays(layer, "arrays", where))
        assets = read_labelled_arrays(layer, "assets", where)
        state.assets = {path: content.astype(np.uint8).tobytes() for path, content in assets}
        states.append(state)
    return states
