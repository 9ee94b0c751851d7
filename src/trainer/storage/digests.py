"""SHA-256 digests of checkpoint files: of a file, of bytes in memory, and of a file its
writer just finished, computed in a thread while the save goes on (``PendingDigest``).
A module of its own so manifests (``integrity``), the HDF5 seal and the store's uploads
share one algorithm and one way to hash."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path

ALGORITHM = "sha256"


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, ALGORITHM).hexdigest()


def bytes_digest(data: bytes | memoryview) -> str:
    return hashlib.new(ALGORITHM, data).hexdigest()


# Files smaller than this are hashed in the caller's thread (a small model's variables:
# their digest takes microseconds, a thread's start and join about a hundred).
_THREAD_FROM = 1 << 20


class PendingDigest:
    """The size and digest of a file its writer just finished, computed in a thread while
    the save goes on, for ``build_manifest``'s ``known``. hashlib releases the GIL on large
    buffers, so on a second core the digest of a large model's variables (97 MiB: 50 ms)
    runs beside the rest of the save (its metadata, layer records, fingerprint) instead of
    after it. The file must not change once this starts."""

    def __init__(self, path: str | os.PathLike):
        self._path = os.fspath(path)
        self._result: tuple[int, str] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        try:
            small = os.stat(self._path).st_size < _THREAD_FROM
        except OSError:
            small = True  # _run records the error, which result() raises
        if small:  # hashed at once: a thread would cost more than the digest
            self._run()
            return
        self._thread = threading.Thread(target=self._run, name="trainer-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            size = os.stat(self._path).st_size
            self._result = (size, file_digest(Path(self._path)))
        except BaseException as error:  # raised again, in the caller's thread, by result()
            self._error = error

    def result(self) -> tuple[int, str]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


# What a writer knows of the files it wrote: relative path -> (size, digest), or pending.
Known = Mapping[str, "tuple[int, str] | PendingDigest"]
