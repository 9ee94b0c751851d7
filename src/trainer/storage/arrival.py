"""Files of a checkpoint still arriving from object storage while it is being loaded.

A load from a store used to download every object, then load the local copy: two waits
one after the other, each about as long as the other for a large model on a fast link.
Yet the load needs the big file (a SavedModel's ``variables.data``) only once the model
is rebuilt from the small ones (config, ``saved_model.pb``), which is exactly how the
local load already hides the hashing of that file (``integrity.DigestCheck``). So the
cache starts the download of the large objects first, in a thread, downloads the small
ones meanwhile, hands the directory to the load, and lets the large files the backend
reads late (``SaveBackend.read_late``) arrive while it loads, checking each against the
commit marker as it arrives (``trainer.storage.cache``).

An ``Arrival`` says which files are still arriving (the load's integrity check waits for
them in its digest thread, where it waits for their hash on disk, and the backend reads
them only after ``integrity.await_digests``), and which files this process has just
checked against the marker. The manifest check of the same load does not hash those a
second time when the manifest records the same size and SHA-256 and the file is still the
one checked (same inode, size and modification time): every byte is still hashed once
against a digest equal to the manifest's. Only the load the ``Arrival`` is set for
(``arriving``) trusts it; a cache entry reused from disk has none, so it is hashed again.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainer.errors import IntegrityError

_ARRIVING: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar(
    "trainer_arriving_files", default=None
)


class Arrival:
    """The download of a cache entry's late files (a thread, or nothing left to do), and
    the files this process checked against the marker (relative path -> identity and
    digest)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._root = os.path.realpath(directory)
        self.pending: set[str] = set()  # relative paths still downloading
        self._checked: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # (relative, start, end) -> bytes of that object, set by the cache
        self.fetch_range: Callable[[str, int, int], bytes] | None = None
        self._served: list[tuple[str, int, bytes]] = []
        self._ranges_checked = False  # the download ended: ranges are compared at once

    def checked(self, relative: str, sha256: str) -> None:
        """Record that ``relative`` was just hashed and matched ``sha256`` (the marker's)."""
        with self._lock:
            self._checked[relative] = (_identity(self.directory / relative), sha256)

    def vouches(self, directory: Path, entry: dict[str, Any]) -> bool:
        """Whether the manifest entry ``entry`` of ``directory`` is a file this process
        hashed against the same size and SHA-256, unchanged since."""
        if os.path.realpath(directory) != self._root:
            return False
        with self._lock:
            found = self._checked.get(entry["path"])
        if found is None or found[1] != entry["sha256"]:
            return False
        try:
            return _identity(self.directory / entry["path"]) == found[0] and (
                found[0][1] == entry["size"]
            )
        except OSError:
            return False

    def read_range(self, relative: str, offset: int, size: int) -> bytes | None:
        """Bytes ``offset`` to ``offset + size`` of the pending file ``relative``, fetched
        from the store now (a ranged GET), before the whole file arrives; None if this
        arrival cannot. The bytes are compared with the file the download verified
        (``check_ranges``), so the load uses no byte that was not checked: at the end of
        the download, or here at once when it has already ended."""
        if self.fetch_range is None or relative not in self.pending:
            return None
        data = self.fetch_range(relative, offset, offset + size)
        with self._lock:
            late = self._ranges_checked
            if not late:
                self._served.append((relative, offset, data))
        if late:  # the download ended while this range was read: it is here to compare
            self._compare(relative, offset, data)
        return data

    def check_ranges(self) -> None:
        """Raise ``IntegrityError`` if a range served early differs from the verified
        file (the object was replaced between the two requests). Called once the
        download is complete; a range served after it is compared as it is served."""
        with self._lock:
            served = list(self._served)
            self._ranges_checked = True
        for relative, offset, data in served:
            self._compare(relative, offset, data)

    def _compare(self, relative: str, offset: int, data: bytes) -> None:
        with open(self.directory / relative, "rb") as handle:
            handle.seek(offset)
            if handle.read(len(data)) != data:
                raise IntegrityError(
                    f"{self.directory / relative}: the bytes read from the store ahead "
                    f"of the download (at offset {offset}) differ from the downloaded "
                    f"file, which matches the commit marker: the object was replaced "
                    f"while it was read. Load again. Received: {len(data)} bytes",
                    path=self.directory,
                    file=relative,
                )

    def is_pending(self, directory: Path, relative: str) -> bool:
        return relative in self.pending and os.path.realpath(directory) == self._root

    def start(self, work: Any) -> None:
        """Run ``work()`` (the download of ``pending``) in a thread; ``wait`` re-raises."""

        def run() -> None:
            try:
                work()
            except BaseException as error:  # re-raised by wait() in the loading thread
                self._error = error

        self._thread = threading.Thread(target=run, name="trainer-download", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until every pending file arrived and matched the marker; raise the error
        of the download or of the first file that did not match."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error


def _identity(path: Path) -> tuple[int, int, int]:
    info = os.lstat(path)
    return info.st_ino, info.st_size, info.st_mtime_ns


@contextlib.contextmanager
def arriving(arrival: Arrival | None) -> Iterator[None]:
    """``arrival`` is the one the integrity checks of this load consult (this thread)."""
    token = _ARRIVING.set(arrival)
    try:
        yield
    finally:
        _ARRIVING.reset(token)


def current() -> Arrival | None:
    return _ARRIVING.get()
