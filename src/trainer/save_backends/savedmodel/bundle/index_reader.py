"""Find one entry of a tensor bundle's index (``variables/variables.index``) without
TensorFlow's reader, which needs the data file too.

Why: a load from object storage rebuilds the model while the 100 MB data file still
downloads (``trainer.storage.arrival``), but the rebuild needs the checkpoint's object
graph (which stored tensor belongs to which variable), itself a tensor of the data file.
Its offset and size are in the small index, read here; the load then fetches those bytes
alone (``Arrival.read_range``). The layout is the one ``tensor_bundle`` writes (see its
docstring): a 48-byte footer pointing at the index block, whose entries point at the data
blocks, each a run of prefix-compressed keys. Anything unexpected (a compressed block, a
damaged table) returns None: the caller then waits for the whole data file and reads it
with TensorFlow, which reports damage in its own words.
"""

from __future__ import annotations

import struct
from pathlib import Path

from tensorflow.core.protobuf import tensor_bundle_pb2

_FOOTER = 48
_MAGIC = struct.pack("<II", 0x8B80FB57, 0xDB477524)
_TRAILER = 5  # a block's compression type byte and its masked CRC32C


def find_entry(index: Path, key: str) -> tensor_bundle_pb2.BundleEntryProto | None:
    """The ``BundleEntryProto`` of ``key`` in the index file ``index``, or None (absent,
    or a table this reader does not handle)."""
    try:
        data = Path(index).read_bytes()
        if len(data) < _FOOTER or data[-8:] != _MAGIC:
            return None
        footer = data[-_FOOTER:]
        _meta_offset, at = _varint(footer, 0)
        _meta_size, at = _varint(footer, at)
        index_offset, at = _varint(footer, at)
        index_size, _ = _varint(footer, at)
        wanted = key.encode()
        for _separator, handle in _entries(_block(data, index_offset, index_size)):
            offset, at = _varint(handle, 0)
            size, _ = _varint(handle, at)
            for found, value in _entries(_block(data, offset, size)):
                if found == wanted:
                    return tensor_bundle_pb2.BundleEntryProto.FromString(value)
    except (ValueError, IndexError, struct.error, OSError):
        return None
    except Exception as error:  # protobuf's DecodeError
        if type(error).__name__ == "DecodeError":
            return None
        raise
    return None


def _block(data: bytes, offset: int, size: int) -> bytes:
    if data[offset + size] != 0:  # compressed: TensorFlow writes bundles uncompressed
        raise ValueError("compressed block")
    if offset + size + _TRAILER > len(data):
        raise ValueError("block beyond the file")
    return data[offset : offset + size]


def _entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a table block, keys expanded from their shared prefixes."""
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * restarts
    found, at, last = [], 0, b""
    while at < end:
        shared, at = _varint(block, at)
        own, at = _varint(block, at)
        length, at = _varint(block, at)
        if shared > len(last) or at + own + length > end:
            raise ValueError("damaged block entry")
        last = last[:shared] + block[at : at + own]
        at += own
        found.append((last, block[at : at + length]))
        at += length
    return found


def _varint(data: bytes, at: int) -> tuple[int, int]:
    number, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        number |= (byte & 0x7F) << shift
        if byte < 0x80:
            return number, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def scalar_string(raw: bytes) -> bytes | None:
    """The element of a scalar string tensor's bytes in a bundle (its length as a varint,
    a masked CRC32C of the length, then the element), or None if they are not that."""
    try:
        length, at = _varint(raw, 0)
    except (IndexError, ValueError):
        return None
    at += 4
    return raw[at:] if len(raw) - at == length else None
