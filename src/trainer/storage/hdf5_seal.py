"""The single-file ``h5`` backend's manifest, in the HDF5 *user block*: the first 512
bytes of the file, which HDF5 reserves for applications and skips. It holds the file size
and the SHA-256 of every byte after the block, so a damaged ``.h5`` is refused on load as
a damaged directory checkpoint is (``integrity``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trainer.errors import IncompatibleFormatError, IntegrityError
from trainer.storage.digests import ALGORITHM, bytes_digest
from trainer.storage.integrity import FORMAT, HDF5_LOCATION, HDF5_USERBLOCK, VERSION

_MAGIC = b"TRAINER-MANIFEST "
_CHUNK = 1 << 20


def seal_hdf5(data: memoryview | bytes) -> bytes:
    """The user block to put in front of ``data[HDF5_USERBLOCK:]``: size and digest.

    ``data`` is an HDF5 file created with ``userblock_size=HDF5_USERBLOCK``.
    """
    header = {
        "format": FORMAT,
        "version": VERSION,
        "algorithm": ALGORITHM,
        "size": len(data),
        "offset": HDF5_USERBLOCK,
        "sha256": bytes_digest(memoryview(data)[HDF5_USERBLOCK:]),
    }
    block = _MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n"
    return block.ljust(HDF5_USERBLOCK, b"\0")


def read_hdf5_seal(path: Path) -> dict[str, Any] | None:
    """The manifest in the user block of ``path``, or None (an HDF5 file without one)."""
    with open(path, "rb") as handle:
        block = handle.read(HDF5_USERBLOCK)
    if not block.startswith(_MAGIC):
        return None
    try:
        header = json.loads(block[len(_MAGIC) :].rstrip(b"\0").decode())
        ok = (
            isinstance(header, dict)
            and header.get("format") == FORMAT
            and type(header.get("size")) is int
            and header.get("offset") == HDF5_USERBLOCK
            and isinstance(header.get("sha256"), str)
        )
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise IntegrityError(
            f"{path}: the manifest in the HDF5 user block is damaged. Load an older "
            f"checkpoint. Received block start: {block[:80]!r}",
            path=path,
            file=HDF5_LOCATION,
        )
    if type(header.get("version")) is not int or header["version"] > VERSION:
        raise IncompatibleFormatError(
            f"{path} was written with manifest version {header.get('version')!r}, but this "
            f"trainer reads versions up to {VERSION}. Upgrade trainer to load it. "
            f"Received version={header.get('version')!r}"
        )
    return header


def verify_hdf5(path: Path, *, digests: bool) -> dict[str, Any] | None:
    """Check the file against its user-block manifest; None if it has none."""
    path = Path(path)
    header = read_hdf5_seal(path)
    if header is None:
        return None
    size = path.stat().st_size
    if size != header["size"]:
        raise IntegrityError(
            f"{path} has {size} bytes instead of {header['size']} (truncated or appended "
            f"to); the checkpoint is damaged. Load an older checkpoint. Received size {size}",
            path=path,
            file=path.name,
        )
    if digests:
        digest = hashlib.new(ALGORITHM)
        with open(path, "rb") as handle:
            handle.seek(header["offset"])
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != header["sha256"]:
            raise IntegrityError(
                f"{path} does not match its SHA-256 digest: its content changed after it "
                f"was written. Load an older checkpoint. Received another digest",
                path=path,
                file=path.name,
            )
    return {"files": [{"path": path.name, "size": size, "sha256": header["sha256"]}], **header}
