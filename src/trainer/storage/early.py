"""Uploads of a checkpoint's finished files that start while the backend still writes the
rest of it locally.

Without them a save to object storage is the local write and then the upload, one after
the other; the largest file (a large model's variables, 97 MiB of its 97.5) is finished
well before the write ends, and its upload is most of the upload. A backend tells of such
a file (``trainer.save_backends.early_files``), and ``EarlyUploads.add`` starts its PUT at
once, in a thread.

What keeps this safe is the commit marker (``trainer.storage.remote``): it is written after
every object, by ``publish``, and only once the local write has succeeded, so an object
uploaded early is listed by nothing until then. The intent record ``.pending/<name>`` is
on the store before the first early PUT (``begin`` writes it; every upload waits for it),
so a writer killed after one leaves objects the next writer deletes. A failed local write
deletes what was uploaded (``RemoteCheckpoints.abandon``). An earlier checkpoint of the
same name must stay whole until the new one's upload starts for real: where ``begin``
found one, nothing is uploaded early (``publish`` removes it, then uploads everything).

The bytes sent are those the backend hashed while writing them: the file is opened when
it is announced (the rename of the backend's temporary directory does not move an open
file away) and its size checked when read; ``publish`` reuses an early object only where
the manifest records the same size and digest, and a load checks the digest again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.storage.store import Store

log = logging.getLogger(__name__)
# (size, SHA-256) of each relative path uploaded early
Uploaded = dict[str, tuple[int, str]]


class EarlyUploads:
    """The early uploads of one publication of directory checkpoint ``name``. ``begun``:
    ``RemoteCheckpoints.begin_in_background``'s future (the intent record, and whether
    an earlier checkpoint of that name is there)."""

    def __init__(self, store: Store, name: str, begun: Future[tuple[bool, list[str]]]):
        self.store = store
        self.name = name
        self.begun = begun
        # (relative path, its upload: its size and digest, or None where it was skipped)
        self._uploads: list[tuple[str, Future[tuple[int, str] | None]]] = []
        self._executor: ThreadPoolExecutor | None = None

    def add(self, directory: Path, relative: str, size: int, sha256: str) -> None:
        """Start uploading ``directory/relative`` (finished: ``size`` bytes hashing to
        ``sha256``) under ``<name>/<relative>``. The file is opened now, before the save
        goes on and renames its directory."""
        handle = open(directory / relative, "rb")  # noqa: SIM115 -- closed by the upload
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainer-early")
        upload = self._executor.submit(self._upload, handle, relative, size, sha256)
        self._uploads.append((relative, upload))

    def _upload(self, handle: Any, relative: str, size: int, sha256: str) -> Any:
        with handle:
            had, earlier = self.begun.result()  # the intent record is on the store
            if had or earlier:  # the earlier checkpoint stays whole until ``publish``
                return None
            data = handle.read()
        if len(data) != size:  # not the file announced: ``publish`` uploads it
            return None
        self.store.put_bytes(f"{self.name}/{relative}", data)
        return size, sha256

    def relatives(self) -> set[str]:
        """The paths (relative to the checkpoint) of the files whose upload started."""
        return {relative for relative, _ in self._uploads}

    def finish(self) -> Uploaded:
        """Wait for every early upload; the ones that succeeded, for ``publish`` to skip.
        One that failed is uploaded again by ``publish``, which reports the store's error
        if it fails again."""
        done: Uploaded = {}
        for relative, upload in self._wait():
            try:
                result = upload.result()
            except Exception as error:
                log.info("An early upload of %s failed; uploaded again: %s", self.name, error)
                continue
            if result is not None:
                done[relative] = result
        return done

    def keys(self) -> list[str]:
        """Wait for every early upload; the keys (relative to the store) of the objects
        they wrote or may have written (a PUT that failed may have landed), for a failed
        save to delete. Not the skipped ones: those keys may hold an earlier checkpoint's
        objects."""
        return [
            f"{self.name}/{relative}"
            for relative, upload in self._wait()
            if upload.exception() is not None or upload.result() is not None
        ]

    def _wait(self) -> list[tuple[str, Future[tuple[int, str] | None]]]:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        return self._uploads
