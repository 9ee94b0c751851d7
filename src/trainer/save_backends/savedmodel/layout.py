"""The on-disk layout of a trainer SavedModel and its metadata file.

::

    D/saved_model.pb                     object graph + traced functions (TF SavedModel)
    D/fingerprint.pb                     TF's fingerprint of the SavedModel
    D/variables/variables.{index,data*}  every model and optimizer variable, stored once
    D/assets/                            TF assets (e.g. lookup vocabularies)
    D/assets/keras/<layer id>/vocabulary.json lookup layers' vocabularies, for config revival
    D/assets.extra/trainer_metadata.json per-layer records, compile config, training state

The metadata file is written last: its presence marks the directory as complete and as
ours. A SavedModel without it is a plain TF export that trainer will not try to revive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import CorruptCheckpointError, NotACheckpointError
from trainer.storage import integrity

METADATA_DIR = "assets.extra"
METADATA_FILE = "trainer_metadata.json"
FORMAT = "trainer-savedmodel"


def metadata_path(directory: Path) -> Path:
    return Path(directory) / METADATA_DIR / METADATA_FILE


def is_saved_model(directory: Path) -> bool:
    directory = Path(directory)
    return directory.is_dir() and (
        (directory / "saved_model.pb").is_file() or (directory / "saved_model.pbtxt").is_file()
    )


def has_metadata(directory: Path) -> bool:
    return is_saved_model(directory) and metadata_path(directory).is_file()


def encode(value: Any) -> str:
    """Compact JSON: the per-layer records are most of a small model's export (issue 17)."""
    return integrity.compact_json(value)


def write_metadata(
    directory: Path, metadata: dict[str, Any], encoded: dict[str, str] | None = None
) -> bytes:
    """Write the metadata file and return its bytes; ``encoded`` holds entries already
    encoded as JSON (by :func:`encode`), written as they are. Not flushed to disk here:
    the save syncs the whole directory before publishing it (``atomic_write``)."""
    path = metadata_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = encoded or {}
    keys = sorted({*metadata, *encoded})
    entries = (
        f"{json.dumps(k)}:{encoded[k] if k in encoded else encode(metadata[k])}" for k in keys
    )
    data = ("{" + ",".join(entries) + "}").encode("utf-8")
    with open(path, "wb") as handle:
        handle.write(data)
    return data


def read_metadata(directory: Path) -> dict[str, Any]:
    directory = Path(directory)
    if is_saved_model(directory) and not metadata_path(directory).exists():
        raise NotACheckpointError(
            f"{directory} is a plain TensorFlow SavedModel without trainer metadata "
            f"({METADATA_DIR}/{METADATA_FILE}), so its Keras layers cannot be revived. "
            f"Serve it with tf.saved_model.load(path).signatures['serving_default'] or wrap "
            f"it with keras.layers.TFSMLayer(path, call_endpoint='serving_default'). "
            f"Received: {str(directory)!r}"
        )
    try:
        with open(metadata_path(directory), encoding="utf-8") as handle:
            metadata = json.load(handle)
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(
            f"The metadata file of {directory} cannot be read ({err}); the checkpoint is "
            f"damaged. Re-save it or load an older one. Received: {str(directory)!r}"
        ) from None
    if not isinstance(metadata, dict) or metadata.get("savedmodel", {}).get("format") != FORMAT:
        raise CorruptCheckpointError(
            f"{metadata_path(directory)} is not trainer SavedModel metadata (no "
            f"'savedmodel.format' = {FORMAT!r}). Received keys: {sorted(metadata)[:10]}"
        )
    return metadata


# Lookup layers' vocabularies, one folder per layer: ``VOCAB_DIR/<layer id>/VOCAB_FILE``
# (``trace_cache.write_vocabularies``; read by ``read_vocabulary``).
VOCAB_DIR = "assets/keras"
VOCAB_FILE = "vocabulary.json"
_OLDER_VOCAB_FILE = "vocabulary.txt"  # one token per line: format version 1


def vocabulary_folder(directory: Path, layer_id: int | str) -> Path:
    return Path(directory) / VOCAB_DIR / str(layer_id)


def read_vocabulary(folder: Path, layer: Any) -> list[Any] | None:
    """A lookup layer's vocabulary (special tokens first) as ``write_vocabularies`` stored
    it in ``folder``, typed as the layer's tokens; None if none is stored. Checkpoints
    written before kept it as text, one token per line (``vocabulary.txt``): an
    ``IntegerLookup``'s lines are read back as integers, which they were."""
    stored = Path(folder) / VOCAB_FILE
    if stored.is_file():
        try:
            words = json.loads(stored.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            words = error
        if not isinstance(words, list):
            raise CorruptCheckpointError(
                f"{stored} must hold a JSON list of tokens; the checkpoint is damaged. Load "
                f"an older checkpoint. Received: {str(words)[:200]}"
            )
        return words
    older = Path(folder) / _OLDER_VOCAB_FILE
    if not older.is_file():
        return None
    lines = older.read_text(encoding="utf-8").splitlines()
    if str(getattr(layer, "vocabulary_dtype", "string")) == "string":
        return lines
    try:
        return [int(line) for line in lines]
    except ValueError:
        raise CorruptCheckpointError(
            f"{older} holds a token that is not an integer, but its layer "
            f"{getattr(layer, 'name', '?')!r} looks up integers; the checkpoint is damaged. "
            f"Received: {[x for x in lines if not x.lstrip('-').isdigit()][:3]}"
        ) from None
