"""The local cache of checkpoints read from object storage: one verified copy per distinct
content, reused across resumes and loads, bounded in size.

Backends load local files (TensorFlow's SavedModel reader, h5py), so a checkpoint on a
store is downloaded first. The cache entry is keyed by the digest of the commit marker's
object list (every file's path, size and SHA-256, the checkpoint manifest's digest among
them): the same checkpoint read twice, by two resumes or two processes, is downloaded once,
and a checkpoint replaced under the same name gets a new entry. An entry appears whole by
a rename of its temporary download directory after every object matched its size and
digest; the backend's own integrity check runs again on load.

``TRAINER_STORE_CACHE`` sets the directory (default ``~/.cache/trainer/store``),
``TRAINER_STORE_CACHE_BYTES`` the bound (default 20 GiB): after each download the least
recently used entries beyond it are removed, never the one just fetched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from trainer.errors import IntegrityError, StoreError
from trainer.storage import integrity
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
    root = cache_root()
    entry = root / content_key(objects)
    final = entry / name
    if final.exists():
        os.utime(entry)  # most recently used
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(root)
    tmp = root / f"{_TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        target = tmp / name
        pairs = []
        for item in objects:
            local = target / item["path"] if kind == "directory" else target
            key = f"{name}/{item['path']}" if kind == "directory" else name
            integrity.safe_relative(item["path"], target)  # never outside the entry
            local.parent.mkdir(parents=True, exist_ok=True)
            pairs.append((key, local))
        store.get_files(pairs)  # concurrently (one after another, each waits a round trip)
        for (key, local), item in zip(pairs, objects, strict=True):
            _check(local, item, store.url_of(key))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process cached the same content meanwhile
            if not final.exists():
                raise
    finally:
        remove_path(tmp)
    evict(root, cache_limit(), keep=entry)
    return final


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


def evict(root: Path, limit: int, *, keep: Path) -> list[Path]:
    """Remove least recently used entries until the cache holds at most ``limit`` bytes
    (``keep`` stays even if it alone is larger). Returns the entries removed."""
    entries = []
    for child in root.iterdir():
        if child.name.startswith(_TMP) or is_temporary(child) or not child.is_dir():
            continue
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
