"""What a path that is not a checkpoint is instead, and what to do with it.

Why: the commonest wrong path is one level off (a run directory, its ``checkpoints/``
folder) or a file in another format (a ``.keras`` archive, a Keras HDF5 model or weights
file, a plain SavedModel). Telling the user which of those it is, and the command or
function that opens it, beats a generic "not a checkpoint".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

LATEST = "latest"  # the pointer the checkpoint callback keeps in a checkpoints folder
_SCAN = 64  # entries looked at per directory: the hint must stay cheap on huge folders


def advice(path: Path, is_checkpoint: Callable[[Path], bool]) -> str:
    """One or two sentences for the error message; ``is_checkpoint`` tells whether a
    path is a complete checkpoint of a registered backend."""
    if path.is_dir():
        return _directory_advice(path, is_checkpoint)
    if path.is_file():
        return _file_advice(path)
    return GENERIC


# The advice for a path nothing here recognises: only then may a third-party backend's
# format be the explanation (the caller adds how to register one).
GENERIC = (
    "trainer checkpoints are the entries of a run's checkpoints/ folder; "
    "python -m trainer runs OUTPUT_DIR lists them."
)


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(itertools.islice(directory.iterdir(), _SCAN))
    except OSError:
        return []


def _checkpoints_in(directory: Path, is_checkpoint: Callable[[Path], bool]) -> list[Path]:
    """Checkpoints directly inside ``directory`` (``latest`` first when present)."""
    found = [
        p for p in _entries(directory) if not p.name.startswith(".") and _safe(is_checkpoint, p)
    ]
    latest = directory / LATEST
    if latest.is_symlink() or latest in found:
        found = [latest, *[p for p in found if p != latest]]
    return found


def _safe(is_checkpoint: Callable[[Path], bool], path: Path) -> bool:
    try:
        return bool(is_checkpoint(path))
    except (OSError, ValueError):
        return False


def _directory_advice(path: Path, is_checkpoint: Callable[[Path], bool]) -> str:
    inside = _checkpoints_in(path, is_checkpoint)
    if inside:
        return (
            f"It is a folder of checkpoints, not a checkpoint: pass one of them, e.g. "
            f"{inside[0]}{' (the newest)' if inside[0].name == LATEST else ''}; "
            f"python -m trainer runs {path.parent} lists them all."
        )
    for sub in _entries(path):
        if sub.is_dir() and not sub.is_symlink() and _checkpoints_in(sub, is_checkpoint):
            newest = _checkpoints_in(sub, is_checkpoint)[0]
            return (
                f"It is a training run directory: its newest checkpoint is {newest}; "
                f"python -m trainer runs {path} lists its checkpoints and exports."
            )
    if (path.parent / ".hydra").is_dir() and not _entries(path):
        return (
            f"It is a training run's checkpoint folder without checkpoints yet; python -m "
            f"trainer runs {path.parent} lists what the run holds."
        )
    if (path / ".hydra").is_dir():
        return (
            f"It is a training run directory without checkpoints yet; python -m trainer "
            f"runs {path} lists what it holds."
        )
    if any(True for _ in itertools.islice(path.glob("*/.hydra"), 1)) or any(
        True for _ in itertools.islice(path.glob("*/*/.hydra"), 1)
    ):
        return (
            f"It is an outputs directory holding runs: python -m trainer runs {path} lists "
            f"every run with its checkpoints."
        )
    if (path / "saved_model.pb").is_file():
        return (
            "It is a plain TensorFlow SavedModel (not written by trainer): open it with "
            "tf.saved_model.load or keras.layers.TFSMLayer."
        )
    return GENERIC


def _file_advice(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".keras"):
        return (
            "It is a Keras archive (.keras), not a trainer checkpoint: load it with "
            f"keras.saving.load_model({str(path)!r})."
        )
    kind = _hdf5_kind(path)
    if kind == "model" and not name.endswith(".weights.h5"):
        return (
            "It is a Keras HDF5 model file (model.save in the legacy .h5 format), not a "
            f"trainer checkpoint: load it with keras.saving.load_model({str(path)!r})."
        )
    if kind is not None and (kind == "weights" or name.endswith(".weights.h5")):
        return (
            "It is a Keras weights file, not a trainer checkpoint: build the model, then "
            f"call model.load_weights({str(path)!r})."
        )
    if kind is not None:
        return "It is an HDF5 file but not a trainer checkpoint or a Keras model or weights file."
    return GENERIC


def _hdf5_kind(path: Path) -> str | None:
    """``model``, ``weights``, ``other`` for an HDF5 file; ``None`` for anything else."""
    import h5py

    from trainer.save_backends.hdf5_arrays import has_hdf5_signature

    if not has_hdf5_signature(path):
        return None
    try:
        with h5py.File(path, "r") as h5:
            if "model_config" in h5.attrs:
                return "model"
            if "layer_names" in h5.attrs or "layers" in h5 or "vars" in h5:
                return "weights"
            return "other"
    except (OSError, ValueError):
        return None
