"""Why a load refuses a checkpoint: the errors ``SaveBackend.load`` raises besides the
manifest's own, kept apart from the backend contract in ``base``.

Each function returns or raises one ``TrainerError`` that says what is wrong with which
checkpoint, what to do, and what was received; the backend methods that use them stay
overridable hooks.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import tensorflow as tf
from google.protobuf.message import DecodeError

from trainer.errors import (
    CorruptCheckpointError,
    IncompatibleFormatError,
    IntegrityError,
    NotACheckpointError,
    TrainerError,
)
from trainer.storage import targets
from trainer.storage.atomic import is_temporary

# What reading damaged or inconsistent stored data raises inside Keras, TensorFlow, h5py,
# protobuf and json: turned into CorruptCheckpointError at the load boundary. Anything
# else (AttributeError, NameError, AssertionError...) is a bug in trainer and surfaces as
# itself, instead of blaming the checkpoint.
DAMAGED_DATA_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # includes json's JSONDecodeError and UnicodeDecodeError
    TypeError,
    LookupError,  # KeyError, IndexError
    OSError,  # includes h5py's read errors
    EOFError,
    # h5py's errors for damaged HDF5 structures ("bad local heap signature", "link
    # iteration failed"), met when a load skips digests (verify=False, unsealed files);
    # RecursionError too.
    RuntimeError,
    tf.errors.OpError,
    DecodeError,
)


def damaged(path: Path, error: BaseException) -> CorruptCheckpointError:
    """The clear error for a raw one (``DAMAGED_DATA_ERRORS``) met while rebuilding
    untrusted data."""
    return CorruptCheckpointError(
        f"{path} could not be loaded: its content is damaged or inconsistent "
        f"({type(error).__name__} while rebuilding it). Run `python -m trainer "
        f"verify {path}`, or load an older checkpoint. Received error: "
        f"{type(error).__name__}: {str(error)[:500]}"
    )


def refuse_unsealed(path: Path, sealed: bool, metadata: dict[str, Any]) -> None:
    """A checkpoint whose metadata says it was sealed must still have its manifest: one
    without it may have lost or had replaced any file."""
    record = metadata.get("integrity")
    if not sealed and record:
        where = record.get("manifest") if isinstance(record, dict) else record
        raise IntegrityError(
            f"{path}: the manifest of its files ({where!r}) is missing, although the "
            f"checkpoint was written with one; files may have been removed or replaced. "
            f"Restore it from a copy or load an older checkpoint. Received: no manifest",
            path=path,
            file=str(where),
        )


def check_format_version(
    metadata: Any, path: Path, *, backend: str, newest: int, oldest: int
) -> None:
    """Format versions are major versions: newer than ``newest`` or older than ``oldest``
    is refused; metadata of the wrong type is damage, not a version question."""
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(
            f"{path}: the stored metadata must be a JSON object; the checkpoint is "
            f"damaged. Load an older checkpoint. Received {type(metadata).__name__}"
        )
    version = metadata.get("format_version")
    if type(version) is not int:
        raise CorruptCheckpointError(
            f"{path}: the stored format_version must be an integer; the checkpoint is "
            f"damaged. Load an older checkpoint. Received format_version={version!r}"
        )
    if version > newest:
        raise IncompatibleFormatError(
            f"{path} was written in {backend!r} format version {version!r}, but this "
            f"trainer reads versions up to {newest}. Upgrade trainer to load "
            f"it. Received format_version={version!r}"
        )
    if version < oldest:
        raise IncompatibleFormatError(
            f"{path} was written in {backend!r} format version {version}, which this "
            f"trainer no longer reads (oldest supported: {oldest}). "
            f"Load it with an older trainer and save it again. "
            f"Received format_version={version}"
        )


def not_ours(path: Path, backend: str) -> TrainerError:
    """Why ``path`` is not a ``backend`` checkpoint: another backend's, damaged (its
    manifest says which file), a save's temporary, or nothing trainer knows."""
    if is_temporary(path):
        actual = "it is the temporary of a save in progress or of a crashed one"
    elif targets.format_detector() is None:
        actual = "no backend registry was imported to tell what it is"
    else:
        try:
            actual = f"it is a {targets.format_detector()(path).name!r} checkpoint"
        except CorruptCheckpointError as error:
            return error
        except TrainerError as error:
            actual = f"no backend recognises it ({str(error).split('. ')[0]})"
    return NotACheckpointError(
        f"{path} is not a complete {backend!r} checkpoint: {actual}. Load it with "
        f"`trainer.save_backends.load_checkpoint`, which detects the format. "
        f"Received: {str(path)!r}"
    )


def read_options(
    backend: object, signature: inspect.Signature, safe_mode: bool, options: dict[str, Any]
) -> dict[str, Any]:
    """The keyword arguments ``backend._read`` gets besides ``custom_objects`` and ``compile``.

    ``safe_mode`` is part of the ``_read`` contract. A ``_read`` written before it was
    (no ``safe_mode`` parameter) is called without it for one more release, with a
    DeprecationWarning: such a backend has no way to run stored code to allow."""
    parameters = signature.parameters
    if "safe_mode" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return {"safe_mode": safe_mode, **options}
    warnings.warn(
        f"{type(backend).__qualname__}._read takes no safe_mode argument; declare "
        f"`safe_mode: bool` (True: never run code a checkpoint stores). Trainer will pass "
        f"it to every backend's _read from the next release on.",
        DeprecationWarning,
        stacklevel=3,  # the caller of ``load``
    )
    return dict(options)
