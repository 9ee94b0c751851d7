"""The local cache of checkpoints read from object storage: one verified copy per distinct
content, reused across resumes and loads, bounded in size.

Backends load local files (TensorFlow's SavedModel reader, h5py), so a checkpoint on a
store is downloaded first. The cache entry is keyed by the digest of the commit marker's
object list (every file's path, size and SHA-256, the checkpoint manifest's digest among
them): the same checkpoint read twice, by two resumes or two processes, is downloaded once,
and a checkpoint replaced under the same name gets a new entry. An entry appears whole by
a rename of its temporary download directory after every object matched its size and
digest; the backend's own integrity check runs again on load. A load (``load_checkpoint``)
instead writes the entry in place under a claim file and reads the small objects while the
large ones still arrive (``fetch_overlapped``, ``trainer.storage.arrival``); the entry
counts as cached only once the claim is gone.

``TRAINER_STORE_CACHE`` sets the directory (default ``~/.cache/trainer/store``),
``TRAINER_STORE_CACHE_BYTES`` the bound (default 20 GiB): after each download the least
recently used entries beyond it are removed, never the one just fetched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from trainer.errors import IntegrityError, StoreError
from trainer.storage import integrity
from trainer.storage.arrival import Arrival
from trainer.storage.atomic import is_temporary, process_alive, remove_path

CACHE_ENV = "TRAINER_STORE_CACHE"
LIMIT_ENV = "TRAINER_STORE_CACHE_BYTES"
DEFAULT_LIMIT = 20 << 30
_TMP = ".download-"


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer" / "store"


def cache_limit() -> int:
    text = os.environ.get(LIMIT_ENV)
    if not text:
        return DEFAULT_LIMIT
    try:
        return int(text)
    except ValueError:
        raise StoreError(
            f"{LIMIT_ENV} must be a number of bytes (the local cache of checkpoints read from "
            f"object storage). Received: {text!r}"
        ) from None


def staging_dir(url: str) -> Path:
    """The default local directory where checkpoints for ``url`` are written before their
    upload: one per URL, next to the cache (``TRAINER_STORE_CACHE``'s parent)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return cache_root().parent / "staging" / digest


def content_key(objects: list[dict[str, Any]]) -> str:
    """The digest naming a cache entry: of every object's path, size and SHA-256."""
    listed = sorted((e["path"], e["size"], e["sha256"]) for e in objects)
    return hashlib.sha256(integrity.compact_json(listed).encode()).hexdigest()[:32]


def fetch_objects(store: Any, name: str, kind: str, objects: list[dict[str, Any]]) -> Path:
    """The local path of checkpoint ``name`` (``kind`` "file" or "directory") of ``store``,
    downloaded and checked against ``objects`` unless the cache holds it already."""
    fetched, arrival = fetch_overlapped(store, name, kind, objects, None)
    if arrival is not None:
        arrival.wait()
    return fetched


def fetch_overlapped(
    store: Any,
    name: str,
    kind: str,
    objects: list[dict[str, Any]],
    late: Callable[[Path], tuple[str, ...]] | None,
) -> tuple[Path, Arrival | None]:
    """Like ``fetch_objects``, but a directory's large late-read files may still be
    downloading when this returns: ``late(partial)`` is asked, once every other object
    is there and checked, which ``fnmatch`` patterns the load reads only after
    ``integrity.await_digests`` (() for none). The returned ``Arrival`` (None when nothing
    is left to download) finishes them in a thread; the load waits for it
    (``trainer.storage.arrival``). Such an entry is written in place under a claim file
    (``.loading-<key>``, the writer's pid) instead of renamed into place: the path the
    load reads stays the entry's. Another reader waits for the claim to go."""
    root = cache_root()
    key = content_key(objects)
    entry = root / key
    final = entry / name
    root.mkdir(parents=True, exist_ok=True)
    while True:
        if final.exists() and not _claim_path(root, key).exists():
            os.utime(entry)  # most recently used
            return final, None
        _remove_abandoned(root)  # a dead process's claim too
        if _claim_path(root, key).exists():
            time.sleep(_POLL)  # another download of the same content, in place: wait
            continue
        if late is None or kind != "directory":
            return _fetch_renamed(store, root, entry, name, kind, objects), None
        if _claim(root, key):
            if not final.exists():
                break
            remove_path(_claim_path(root, key))  # completed by another process meanwhile
    return final, _fetch_claimed(store, entry, name, objects, late)


def _fetch_claimed(
    store: Any,
    entry: Path,
    name: str,
    objects: list[dict[str, Any]],
    late: Callable[[Path], tuple[str, ...]],
) -> Arrival:
    """Download into ``entry`` (claimed): the large objects in the returned arrival's
    thread, started first (the longest transfer; the floor a load cannot go under), the
    others meanwhile here; then wait for the large ones unless ``late`` names each. The
    thread ends the claim, complete, only once this thread's objects matched too."""
    root, target = entry.parent, entry / name
    arrival = Arrival(target)
    big = [item for item in objects if item["size"] >= integrity.DEFER_FROM]
    first = [item for item in objects if item not in big]
    try:
        remove_path(entry)  # what a process that died while cleaning its entry left
        for item in big:  # present, empty: a backend recognises its files by their names,
            # and a reader may open one before it reads it (TensorFlow's); each download
            # rewrites the same file in place
            integrity.safe_relative(item["path"], target)
            (target / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (target / item["path"]).touch()
    except BaseException:
        _release(root, entry.name, keep=False)
        raise
    arrival.pending = {item["path"] for item in big}
    arrival.fetch_range = lambda relative, start, end: store.get_range(
        f"{name}/{relative}", start, end
    )
    rest_checked: list[bool] = []  # [True] once every other object matched
    rest_done = threading.Event()

    def finish() -> None:
        """The large objects; then, once this thread's objects are done too, the claim's
        end (complete only if both matched): its one owner from here on."""
        complete = False
        try:
            _download(store, name, target, big, arrival)
            arrival.check_ranges()
            complete = True
        finally:
            rest_done.wait()  # the other objects are written into the entry too
            _release(root, entry.name, keep=complete and bool(rest_checked))

    arrival.start(finish)
    try:
        _download(store, name, target, first, arrival)
        patterns = late(target) if big else ()
        rest_checked.append(True)
    except BaseException:
        rest_done.set()
        with contextlib.suppress(BaseException):
            arrival.wait()  # the thread removes the entry; this thread's error is the one
        raise
    rest_done.set()
    deferred = {i["path"] for i in big if any(fnmatch(i["path"], p) for p in patterns)}
    arrival.pending = deferred
    if len(deferred) < len(big):
        arrival.wait()  # the load reads a large file early: it must be here first
    return arrival


def _download(
    store: Any, name: str, target: Path, items: list[dict[str, Any]], arrival: Arrival | None
) -> None:
    """Download ``items`` of directory checkpoint ``name`` under ``target`` concurrently,
    then check each against its marker entry (recorded in ``arrival``)."""
    pairs = []
    for item in items:
        integrity.safe_relative(item["path"], target)  # never outside the entry
        local = target / item["path"]
        local.parent.mkdir(parents=True, exist_ok=True)
        pairs.append((f"{name}/{item['path']}", local))
    store.get_files(pairs)  # concurrently (one after another, each waits a round trip)
    for (key, local), item in zip(pairs, items, strict=True):
        _check(local, item, store.url_of(key))
        if arrival is not None:
            arrival.checked(item["path"], item["sha256"])


def _fetch_renamed(
    store: Any, root: Path, entry: Path, name: str, kind: str, objects: list[dict[str, Any]]
) -> Path:
    """Download everything into a temporary directory, check it, rename it into place."""
    final = entry / name
    tmp = root / f"{_TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        target = tmp / name
        if kind == "directory":
            _download(store, name, target, objects, None)
        else:
            (item,) = objects
            target.parent.mkdir(parents=True, exist_ok=True)
            store.get_files([(name, target)])
            _check(target, item, store.url_of(name))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process cached the same content meanwhile
            if not final.exists():
                raise
    finally:
        remove_path(tmp)
    evict(root, cache_limit(), keep=entry)
    return final


# A claim: the file ``.loading-<key>`` holding the pid of the process writing entry <key>
# in place; the entry is complete once the claim is gone.
_CLAIM = ".loading-"
_POLL = 0.05


def _claim_path(root: Path, key: str) -> Path:
    return root / f"{_CLAIM}{key}"


def _claim(root: Path, key: str) -> bool:
    """Create the claim of entry ``key`` (False: another process holds it).

    The claim appears with the owner's pid already in it (written to a temporary, then
    hard-linked into place, which fails if the claim exists): a process killed between
    creating an empty claim and writing its pid would leave one no reader could ever
    tell abandoned, and every later load of that content would wait forever."""
    tmp = root / f"{_TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"  # cleaned like a download's
    tmp.write_text(str(os.getpid()))
    try:
        os.link(tmp, _claim_path(root, key))
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


def _release(root: Path, key: str, *, keep: bool) -> None:
    """End the claim of entry ``key``: complete (``keep``), or removed first."""
    if not keep:
        remove_path(root / key)
    remove_path(_claim_path(root, key))
    if keep:
        evict(root, cache_limit(), keep=root / key)


def _check(local: Path, item: dict[str, Any], where: str) -> None:
    size = local.stat().st_size
    if size != item["size"] or integrity.file_digest(local) != item["sha256"]:
        raise IntegrityError(
            f"{where} differs from its commit marker ({size} bytes, expected {item['size']}, "
            f"or another SHA-256): the object changed after the checkpoint was published. "
            f"Load another checkpoint. Received: {size} bytes",
            path=where,
            file=item["path"],
        )


def _remove_abandoned(root: Path) -> None:
    """Downloads of processes that died (their pid in the name) are removed."""
    for child in root.glob(f"{_TMP}*"):
        pid = child.name[len(_TMP) :].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            remove_path(child)
    for claim in root.glob(f"{_CLAIM}*"):  # an entry written in place by a dead process
        try:
            pid = claim.read_text().strip()
        except OSError:
            continue
        if pid.isdigit() and not process_alive(int(pid)):
            remove_path(root / claim.name[len(_CLAIM) :])
            remove_path(claim)


def evict(root: Path, limit: int, *, keep: Path) -> list[Path]:
    """Remove least recently used entries until the cache holds at most ``limit`` bytes
    (``keep`` stays even if it alone is larger). Returns the entries removed."""
    entries = []
    for child in root.iterdir():
        if child.name.startswith(_TMP) or is_temporary(child) or not child.is_dir():
            continue
        if _claim_path(root, child.name).exists():
            continue  # being written in place (or its claim's owner died: see above)
        entries.append((child.stat().st_mtime, child, integrity.total_size(child)))
    total = sum(size for _, _, size in entries)
    removed = []
    for _mtime, child, size in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if child == keep:
            continue
        shutil.rmtree(child, ignore_errors=True)
        total -= size
        removed.append(child)
    return removed
