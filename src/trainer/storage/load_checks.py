"""What a load checks of a directory checkpoint before and while it reads it: the
manifest, every file's presence, type and size, and every digest, the large late-read
files' digests in a thread (``DigestCheck``) that the backend awaits before it reads them
(``await_digests``). Apart from ``integrity`` (how manifests are written and read) because
it is the load's timing, shared with downloads still arriving from a store (``arrival``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from trainer.errors import CorruptCheckpointError
from trainer.storage import arrival as arrivals
from trainer.storage.hdf5_seal import read_hdf5_seal, verify_hdf5
from trainer.storage.integrity import (
    check_digest,
    check_file,
    find_manifest,
    read_manifest,
    verify_directory,
)

# Every load checks every digest. Files named by the backend as read late (a model's
# variable values, read after the model is rebuilt from its small config files) are hashed
# in a thread meanwhile (``DigestCheck``): on a second core the SHA-256 of a large model's
# 97 MiB of variables (0.07 s) costs no wall time. Everything else is checked before the
# backend reads anything.
# Smaller late-read files are checked at once: a thread's start costs more than their hash.
DEFER_FROM = 1 << 20
_PENDING: contextvars.ContextVar[DigestCheck | None] = contextvars.ContextVar(
    "trainer_pending_digests", default=None
)


class DigestCheck:
    """The digests of a checkpoint's late-read files, computed in one thread from the start
    of its load. ``wait`` blocks until they are known and raises the ``IntegrityError`` of
    the first file whose content differs from the manifest's record."""

    def __init__(
        self,
        directory: Path,
        entries: list[dict[str, Any]],
        arrival: arrivals.Arrival | None = None,
    ):
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if entries:
            self._thread = threading.Thread(
                target=self._run, args=(Path(directory), entries, arrival), name="trainer-verify"
            )
            self._thread.daemon = True
            self._thread.start()

    def _run(
        self, directory: Path, entries: list[dict[str, Any]], arrival: arrivals.Arrival | None
    ) -> None:
        """Hash each entry; with ``arrival`` (files still downloading), first wait for the
        download, then check the arrived files' presence and size as ``check_for_load``
        checks the others', and skip the hash of a file the download just hashed against
        the same digest (``Arrival.vouches``)."""
        try:
            if arrival is not None:
                arrival.wait()
                root = os.path.realpath(directory)
                for entry in entries:
                    check_file(directory, root, entry)
            for entry in entries:
                if arrival is None or not arrival.vouches(directory, entry):
                    check_digest(directory, entry)
        except BaseException as error:  # raised in the loading thread by wait()
            self._error = error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error


NOTHING_PENDING = DigestCheck(Path(), [])


def check_for_load(
    directory: Path, relative: str, late: tuple[str, ...] = ()
) -> tuple[dict[str, Any] | None, DigestCheck]:
    """What a load checks of a directory checkpoint: the manifest, every file's presence,
    type and size, and every digest: now, except for files matching a pattern of ``late``
    (``fnmatch``), whose digests the returned ``DigestCheck`` computes in a thread."""
    directory = Path(directory)
    manifest = read_manifest(directory, relative)
    if manifest is None:
        return None, NOTHING_PENDING
    root = os.path.realpath(directory)
    now, deferred = [], []
    arrival = arrivals.current()  # a download from a store still in progress, or None
    for entry in manifest["files"]:
        if arrival is not None and arrival.is_pending(directory, entry["path"]):
            deferred.append(entry)  # checked once it arrived, in the digest thread
            continue
        check_file(directory, root, entry)
        late_read = any(fnmatch(entry["path"], pattern) for pattern in late)
        (deferred if late_read and entry["size"] >= DEFER_FROM else now).append(entry)
    for entry in now:
        if arrival is None or not arrival.vouches(directory, entry):
            check_digest(directory, entry)
    return manifest, DigestCheck(directory, deferred, arrival)


@contextlib.contextmanager
def pending(check: DigestCheck) -> Iterator[None]:
    """``check`` is the one ``await_digests`` waits for inside this block (one load)."""
    token = _PENDING.set(check)
    try:
        yield
    finally:
        _PENDING.reset(token)


def await_digests() -> None:
    """Block until the digests of the checkpoint being loaded in this thread are checked;
    raise the ``IntegrityError`` of a damaged file. A backend calls this before reading
    the files it named as read late; outside a load it returns at once."""
    check = _PENDING.get()
    if check is not None:
        check.wait()


def diagnose(path: Path) -> None:
    """Raise the specific error for a directory no backend claims but that has a manifest.

    A checkpoint whose index file was deleted is no longer recognised by its backend; its
    manifest still says what it was, so the user hears "file X is missing", not "not a
    checkpoint".
    """
    if Path(path).is_file():
        try:
            header = read_hdf5_seal(path)
        except OSError:
            return
        if header is not None:
            verify_hdf5(path, digests=False)
            raise CorruptCheckpointError(
                f"{path} carries a trainer manifest and has its recorded size, but its HDF5 "
                f"content is not a readable trainer checkpoint; it is damaged. Run `python -m "
                f"trainer verify {path}` or load an older checkpoint. Received {path.name!r}"
            )
        return
    found = find_manifest(path)
    if found is None:
        return
    relative, manifest = found
    verify_directory(path, relative, digests=False)
    if manifest.get("kind") == "export" and not manifest.get("backend"):
        return  # an inference-only serving export, intact: not a checkpoint at all
    raise CorruptCheckpointError(
        f"{path} has a trainer manifest (backend {manifest.get('backend')!r}) and all its "
        f"files are intact, but backend {manifest.get('backend')!r} does not recognise it; "
        f"it is not registered in this process, or its index was rewritten. Received "
        f"manifest {relative!r}"
    )
