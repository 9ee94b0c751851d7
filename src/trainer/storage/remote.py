"""Checkpoints on object storage: published by a commit marker written last, found through
the markers only, deleted marker first, read through a local cache.

A store has no atomic rename, so a checkpoint cannot appear whole under its name the way
``trainer.storage.atomic`` makes it appear on disk. Instead the backend writes the
checkpoint into a local directory exactly as it does on disk (manifest, sizes, digests),
and ``publish`` uploads its objects (concurrently, one PUT each), then writes the marker
``.commits/<name>.json`` last: it lists every object with its size and SHA-256. A writer
killed during the upload leaves objects without a marker, which nothing reads (so do the
uploads ``trainer.storage.early`` starts while the backend still writes): listing,
``latest``, resume and load see a checkpoint only through its marker. Retention deletes the
marker first, so a kill during the delete leaves objects without a marker again, never a
marker naming missing objects. ``latest`` is one small object holding a name, replaced by
a single PUT (a reader sees the old name or the new one).

Leftovers are cleaned by the next writer. Before a publication or a delete touches the
objects of ``<name>``, an intent record ``.pending/<name>`` is written, and it is removed
once the marker is written (or the objects are gone). A writer killed in between leaves its
record: the next writer, once it holds the directory's lease (``trainer.storage.lease``),
deletes the objects of every recorded name that has no marker, then the record
(``clean_leftovers``), as orbax cleans a killed writer's temporaries on GCS. Only names a
writer recorded are touched: objects written by anything else under the prefix, and the
objects of checkpoints set aside (their markers moved), are not; a name whose marker is
there is complete and is never deleted by the cleaning.

Layout under a checkpoint directory URL::

    <dir>/<name>/...            a directory checkpoint's files (savedmodel, weights)
    <dir>/<name>.h5             a single-file checkpoint (h5)
    <dir>/.commits/<name>.json  its commit marker, written last
    <dir>/.pending/<name>       the intent record of an upload or delete in progress
    <dir>/latest                the newest checkpoint's name
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainer.errors import CorruptCheckpointError, NotACheckpointError
from trainer.storage import integrity
from trainer.storage.arrival import Arrival
from trainer.storage.cache import fetch_objects, fetch_overlapped
from trainer.storage.early import EarlyUploads
from trainer.storage.store import Store

COMMITS = ".commits"
PENDING = ".pending"
LATEST = "latest"
FORMAT = "trainer-commit"
VERSION = 1
log = logging.getLogger(__name__)


class RemoteCheckpoints:
    """The checkpoints of one directory URL (``s3://bucket/run/checkpoints``)."""

    def __init__(self, url: str):
        self.store = Store(url)
        self.url = self.store.url

    def __repr__(self) -> str:
        return f"RemoteCheckpoints({self.url!r})"

    def url_of(self, name: str) -> str:
        return self.store.url_of(name)

    # ------------------------------------------------------------------ publish
    def begin(self, name: str) -> tuple[bool, list[str]]:
        """What a publication of ``name`` does before its first object: the intent record
        (a kill from here on leaves objects the next writer cleans), then a look for an
        earlier checkpoint of that name (its marker, its objects), which ``publish``
        removes. Reads only, past the record: a writer may run it while the backend still
        writes the local files (``begin_in_background``), and if that write fails, the
        earlier checkpoint is still whole (``abandon`` removes the record)."""
        self.store.put_bytes(_pending_key(name), b"publish")
        return self.store.get_bytes(_marker_key(name)) is not None, self.store.walk_name(name)

    def begin_in_background(self, name: str) -> Future[tuple[bool, list[str]]]:
        """``begin(name)`` in a thread; ``publish(..., begun=future)`` waits for it before
        it changes anything."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-begin")
        try:
            return executor.submit(self.begin, name)
        finally:
            executor.shutdown(wait=False)

    def abandon(self, name: str, uploaded: list[str] = ()) -> None:
        """Remove the intent record of a publication that ``begin`` started and that will
        not happen (the local write failed), after the objects uploaded early
        (``uploaded``: keys from ``EarlyUploads.keys``; no marker lists them). Nothing else
        of ``name`` was changed. If this fails, the record stays and the next writer
        deletes the objects."""
        self.store.delete_all(list(uploaded))
        self.store.delete([_pending_key(name)])

    def publish(
        self,
        local: Path,
        *,
        step: int,
        epoch: int | None = None,
        name: str | None = None,
        last: tuple[str, ...] = (),
        begun: Future[tuple[bool, list[str]]] | None = None,
        latest: bool = False,
        early: EarlyUploads | None = None,
    ) -> dict[str, Any]:
        """Upload the complete local checkpoint ``local`` (a file or a directory) under its
        name (or ``name``), then its commit marker: from that PUT on it is listed and
        loadable. A marker of an earlier checkpoint of the same name is deleted first (then
        its objects), so that no marker ever covers a mix of old and new objects. ``last``:
        relative paths uploaded after every other object (a serving export's
        ``saved_model.pb``, which a model server polling the prefix needs before it loads
        anything). ``begun``: ``begin_in_background``'s future for this name (else ``begin``
        runs now). ``latest``: also point ``latest`` at it, once the marker is written
        (concurrently with the intent record's removal). ``early``: the uploads started during
        the local write (``trainer.storage.early``); the other files are uploaded while
        they finish, and one whose size and digest are not those the manifest records is
        uploaded again. Returns the marker."""
        name = name or local.name
        # its error (an unreachable store) is this publication's
        had, earlier = self.begin(name) if begun is None else begun.result()
        if had:  # an earlier checkpoint of this name: unlisted first, then its objects
            self.store.delete([_marker_key(name)])
        self.store.delete_all(earlier)
        objects = _describe(local)
        started = early.relatives() if early is not None else set()
        rest = [e for e in objects if e["path"] not in last and e["path"] not in started]
        self._upload(local, name, rest)  # while the early ones go on
        done = early.finish() if early is not None else {}
        again = [
            e
            for e in objects
            if e["path"] in started
            and e["path"] not in last
            and done.get(e["path"]) != (e["size"], e["sha256"])
        ]
        self._upload(local, name, again)
        self._upload(local, name, [e for e in objects if e["path"] in last])  # after all
        marker = {
            "format": FORMAT,
            "version": VERSION,
            "name": name,
            "kind": "directory" if local.is_dir() else "file",
            "step": int(step),
            "epoch": epoch,
            "written": time.time(),
            "objects": objects,
        }
        self.store.put_bytes(_marker_key(name), json.dumps(marker, indent=1).encode())
        if latest:  # two independent requests, both after the marker
            with ThreadPoolExecutor(max_workers=1) as executor:
                pointed = executor.submit(self.point_latest, name)
                self.store.delete([_pending_key(name)])
                pointed.result()
        else:
            self.store.delete([_pending_key(name)])
        return marker

    def _upload(self, local: Path, name: str, objects: list[dict[str, Any]]) -> None:
        """Upload these files of ``local`` (``_describe``'s entries), concurrently."""
        self.store.put_files(
            [
                (
                    local / e["path"] if local.is_dir() else local,
                    _object_key(local, name, e["path"]),
                )
                for e in objects
            ]
        )

    def point_latest(self, name: str) -> None:
        """Replace ``latest`` with ``name`` in one PUT."""
        self.store.put_bytes(LATEST, name.encode())

    # -------------------------------------------------------------------- reads
    def marker(self, name: str) -> dict[str, Any] | None:
        """The commit marker of ``name``, or None if it is not a complete checkpoint."""
        data = self.store.get_bytes(_marker_key(name))
        if data is None:
            return None
        return _parse_marker(data, self.url_of(_marker_key(name)))

    def committed(self) -> list[dict[str, Any]]:
        """The markers of every complete checkpoint, lowest step first (then name); objects
        without a marker (an upload or a delete that was cut short) are not among them."""
        found = []
        for entry in self.store.list(COMMITS):
            if not entry.endswith(".json"):
                continue
            try:
                marker = self.marker(entry[: -len(".json")])
            except CorruptCheckpointError as error:
                log.warning("Skipping a checkpoint with a damaged commit marker: %s", error)
                continue
            if marker is not None:  # deleted since it was listed
                found.append(marker)
        return sorted(found, key=lambda m: (m["step"], m["name"]))

    def read_latest(self) -> str | None:
        """The name ``latest`` holds, if that checkpoint is complete; else the newest
        complete one's; None if there is none."""
        found = self._latest()
        return found[0] if found is not None else None

    def _latest(self) -> tuple[str, dict[str, Any]] | None:
        """``read_latest``'s name with its marker (read once: ``resolve`` needs both)."""
        data = self.store.get_bytes(LATEST)
        if data is not None:
            name = data.decode(errors="replace").strip()
            marker = self.marker(name) if name else None
            if marker is not None:
                return name, marker
        found = self.committed()
        return (found[-1]["name"], found[-1]) if found else None

    def resolve(self, name: str) -> tuple[str, dict[str, Any]]:
        """The checkpoint ``name`` names (``latest`` resolved) with its marker; raises
        ``NotACheckpointError`` if there is no complete checkpoint of that name."""
        if name == LATEST:
            chosen = self._latest()
            if chosen is None:
                raise NotACheckpointError(
                    f"{self.url} holds no complete checkpoint, so {self.url_of(LATEST)} names "
                    f"nothing to load. Save one first, or check the URL. Received: "
                    f"{self.url_of(LATEST)!r}"
                )
            return chosen
        marker = self.marker(name)
        if marker is None:
            raise NotACheckpointError(
                f"{self.url_of(name)} is not a complete checkpoint: it has no commit marker "
                f"({self.url_of(_marker_key(name))}), so it was never completely uploaded, is "
                f"being deleted, or never existed. Load another checkpoint (the directory's "
                f"`latest`). Received: {self.url_of(name)!r}"
            )
        return name, marker

    def fetch(self, name: str) -> Path:
        """A verified local copy of the complete checkpoint ``name`` (or ``latest``), from
        the local cache when an earlier fetch left the same objects there."""
        name, marker = self.resolve(name)
        return fetch_objects(self.store, name, marker["kind"], marker["objects"])

    def fetch_for_load(
        self, name: str, late: Callable[[Path], tuple[str, ...]]
    ) -> tuple[Path, Arrival | None]:
        """``fetch`` whose large late-read files (``late``: see
        ``cache.fetch_overlapped``) may still be downloading when it returns: the load
        waits for the returned ``Arrival`` (None: nothing left to download)."""
        name, marker = self.resolve(name)
        return fetch_overlapped(self.store, name, marker["kind"], marker["objects"], late)

    # ------------------------------------------------------------------- delete
    def delete(self, name: str, *, report: bool = True) -> bool:
        """Delete checkpoint ``name``: its marker first (from then on it is not listed),
        then its objects, under an intent record (a kill in between leaves objects the next
        writer cleans). The objects are listed while the record is written: a complete
        checkpoint's objects do not change, and only this writer (the lease's holder)
        adds any. Returns whether it had a marker (one more request; ``report=False``
        skips it and returns False)."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-list") as executor:
            listed = executor.submit(self.store.walk_name, name)
            self.store.put_bytes(_pending_key(name), b"delete")
            had = report and self.store.get_bytes(_marker_key(name)) is not None
            self.store.delete([_marker_key(name)])  # an absent key: a no-op for S3
            self.store.delete_all(listed.result())  # unlisted now: in any order
        self.store.delete([_pending_key(name)])
        return had

    def clean_leftovers(self) -> list[str]:
        """Delete what killed writers left: the objects of every name with an intent record
        (``.pending/<name>``) and no commit marker, then the records. Call it only while
        holding the directory's lease (a live writer's upload is recorded too, and only the
        lease keeps it safe). Returns the names whose objects were deleted."""
        removed = []
        for name in self.store.list(PENDING):
            if self.store.get_bytes(_marker_key(name)) is None:
                self._remove(name)
                removed.append(name)
            self.store.delete([_pending_key(name)])
        return sorted(removed)

    def _remove(self, name: str, *, report: bool = True) -> bool:
        """Delete the marker of ``name`` (first), then its objects. Returns whether it had
        a marker (found with one more request; ``report=False`` skips it)."""
        had = report and self.store.get_bytes(_marker_key(name)) is not None
        self.store.delete([_marker_key(name)])  # an absent key: a no-op for S3
        self.store.delete_all(self.store.walk_name(name))  # unlisted now: in any order
        return had

    def set_aside(self, names: list[str], folder: str) -> None:
        """Hide ``names`` from listing without deleting their objects: each marker is
        copied under ``<folder>/`` and then removed (a resume from an older checkpoint
        abandons the later ones; a later save of the same name replaces them)."""
        for name in names:
            data = self.store.get_bytes(_marker_key(name))
            if data is None:
                continue
            self.store.put_bytes(f"{folder}/{_marker_key(name)}", data)
            self.store.delete([_marker_key(name)])


def _marker_key(name: str) -> str:
    return f"{COMMITS}/{name}.json"


def _pending_key(name: str) -> str:
    return f"{PENDING}/{name}"


def _object_key(local: Path, name: str, relative: str) -> str:
    return f"{name}/{relative}" if local.is_dir() else name


def _describe(local: Path) -> list[dict[str, Any]]:
    """Every file of the local checkpoint with its size and SHA-256 (for a directory, the
    digests its manifest records are reused; only unlisted files, the manifest itself, are
    read again)."""
    if not local.is_dir():
        return [{"path": local.name, **_measure(local)}]
    known = {}
    found = integrity.find_manifest(local)  # the savedmodel backend's is in assets.extra/
    manifest = found[1] if found is not None else None
    if manifest is not None:
        known = {e["path"]: e for e in manifest["files"] if isinstance(e.get("sha256"), str)}
    objects = []
    for root, _dirs, names in os.walk(local):
        for file_name in sorted(names):
            path = Path(root, file_name)
            relative = path.relative_to(local).as_posix()
            entry = known.get(relative)
            if entry is not None and entry.get("size") == path.stat().st_size:
                objects.append({"path": relative, "size": entry["size"], "sha256": entry["sha256"]})
            else:
                objects.append({"path": relative, **_measure(path)})
    return sorted(objects, key=lambda e: e["path"])


def _measure(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": integrity.file_digest(path)}


def _parse_marker(data: bytes, where: str) -> dict[str, Any]:
    """A marker read back, checked field by field (a store's content is as untrusted as a
    file's)."""
    try:
        marker = json.loads(data)
        ok = (
            isinstance(marker, dict)
            and marker.get("format") == FORMAT
            and marker.get("kind") in ("file", "directory")
            and isinstance(marker.get("name"), str)
            and type(marker.get("step")) is int
            and isinstance(marker.get("objects"), list)
            and all(
                isinstance(e, dict)
                and isinstance(e.get("path"), str)
                and type(e.get("size")) is int
                and isinstance(e.get("sha256"), str)
                for e in marker["objects"]
            )
        )
    except ValueError:
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"The commit marker {where} is damaged. Delete it (the checkpoint is then "
            f"ignored) or restore it from a copy. Received: {data[:120]!r}"
        )
    if type(marker.get("version")) is not int or marker["version"] > VERSION:
        raise CorruptCheckpointError(
            f"The commit marker {where} has version {marker.get('version')!r}, newer than "
            f"this trainer reads ({VERSION}). Upgrade trainer. Received: {marker.get('version')!r}"
        )
    return marker
