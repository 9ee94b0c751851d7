"""Checkpoint manifests: every file with its size and SHA-256, written last, checked on load.

The atomic rename already guarantees a reader never sees a half-written checkpoint; the
manifest guarantees that what is read later is still what was written (no truncation by
a full disk or a partial copy, no bit rot, no file swapped in from another checkpoint).

* Directory checkpoints get ``trainer_manifest.json`` (JSON, below) written after every
  other file and before the rename; the SavedModel backend keeps it in ``assets.extra/``.
* The single-file ``h5`` backend writes its manifest into the HDF5 *user block*: the
  first 512 bytes of the file, which HDF5 reserves for applications and skips. It holds
  the file size and the SHA-256 of every byte after the block.

Every ``load`` checks sizes and digests before the bytes reach a model (``check_for_load``;
``verify=False`` checks sizes only); ``python -m trainer verify PATH`` also refuses files
the manifest does not list, then loads.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

from trainer.errors import CorruptCheckpointError, IncompatibleFormatError, IntegrityError
from trainer.storage import arrival as arrivals

MANIFEST_FILE = "trainer_manifest.json"
FORMAT = "trainer-manifest"
VERSION = 1  # major version of the manifest layout; newer ones are refused
ALGORITHM = "sha256"
# Every place a trainer manifest can live in a directory checkpoint, for diagnosis.
KNOWN_LOCATIONS = (MANIFEST_FILE, f"assets.extra/{MANIFEST_FILE}")
HDF5_USERBLOCK = 512
HDF5_LOCATION = "hdf5-userblock"
_MAGIC = b"TRAINER-MANIFEST "
_CHUNK = 1 << 20
_MAX_MANIFEST_BYTES = 16 << 20


# One encoder for every call (``json.dumps`` with arguments builds a new one each time, and
# ``json.dump`` or indented output use the Python encoder): every save writes its manifest
# and metadata with it, in the async writer thread too. Keys keep their order: a Keras
# config's dict of outputs is ordered (sorted, a model with outputs {"z", "a"} came back
# with its per-output losses swapped).
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def compact_json(value: Any) -> str:
    """JSON without spaces, keys in their order, from the C encoder: manifests, metadata."""
    return _COMPACT.encode(value)


# ------------------------------------------------------------------------- digests
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


# ------------------------------------------------------------------ directory manifests
def build_manifest(
    directory: Path,
    relative: str,
    known: Known | None = None,
    **info: Any,
) -> dict[str, Any]:
    """Sizes and digests of every file under ``directory`` except the manifest itself.

    ``known`` maps a relative path to the size and digest of the bytes its writer wrote
    from memory, so that file is not read back to be hashed (every save seals its
    checkpoint, in the async writer thread too). A file whose size on disk differs from
    its known size is hashed from disk. A ``PendingDigest`` is waited for here."""
    top = os.fspath(directory)
    known = known or {}
    files = []
    for root, dirs, names in os.walk(top):  # os calls, not pathlib: every save runs this
        dirs.sort()
        prefix = os.path.relpath(root, top).replace(os.sep, "/") + "/"
        prefix = "" if prefix == "./" else prefix
        for name in sorted(names):
            path, rel = os.path.join(root, name), prefix + name
            if rel == relative:
                continue
            found = os.lstat(path)
            if stat.S_ISLNK(found.st_mode):
                raise CorruptCheckpointError(
                    f"{path} is a symbolic link; a checkpoint must hold only real files so "
                    f"that it can be copied and verified. Received link to {os.readlink(path)}"
                )
            written = known.get(rel)
            if isinstance(written, PendingDigest):
                written = written.result()
            size = found.st_size
            digest = written[1] if written and written[0] == size else file_digest(path)
            files.append({"path": rel, "size": size, "sha256": digest})
    return {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, **info, "files": files}


def write_manifest(
    directory: Path,
    relative: str = MANIFEST_FILE,
    known: Known | None = None,
    **info: Any,
) -> dict[str, Any]:
    """Write the manifest of ``directory`` to ``directory/relative``. Not flushed to disk
    here: the caller syncs the whole directory before publishing it (``fsync_tree``)."""
    manifest = build_manifest(directory, relative, known, **info)
    target = Path(directory) / relative
    if not target.parent.is_dir():  # a stat: a failing mkdir raises and catches an error
        target.parent.mkdir(parents=True)
    with open(target, "w", encoding="utf-8") as handle:
        handle.write(compact_json(manifest))
    return manifest


def known_digest(data: bytes) -> tuple[int, str]:
    """The size and digest of bytes written from memory, for ``build_manifest``'s ``known``."""
    return len(data), bytes_digest(data)


def read_manifest(directory: Path, relative: str = MANIFEST_FILE) -> dict[str, Any] | None:
    """The parsed, schema-checked manifest, or None if the checkpoint has none."""
    path = Path(directory) / relative
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return None
    except OSError as error:
        raise IntegrityError(
            f"{path}: the manifest cannot be read ({error.strerror}); the checkpoint is "
            f"damaged. Load an older checkpoint. Received: {error!r}",
            path=directory,
            file=relative,
        ) from error
    if size > _MAX_MANIFEST_BYTES:
        raise IntegrityError(
            f"{path}: the manifest is {size} bytes, far more than any checkpoint needs "
            f"(limit {_MAX_MANIFEST_BYTES}); it is damaged or not ours. Received size {size}",
            path=directory,
            file=relative,
        )
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:
        raise IntegrityError(
            f"{path}: the manifest is not valid JSON; the checkpoint is damaged. Load an "
            f"older checkpoint. Received error: {type(error).__name__}: {error}",
            path=directory,
            file=relative,
        ) from error
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: Any, where: Path) -> None:
    """Refuse manifests of another format or version, wrong types, or unsafe paths."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IntegrityError(
            f"{where} is not a trainer manifest (no format={FORMAT!r}); the checkpoint is "
            f"damaged. Received: {_short(manifest)}",
            path=where,
        )
    version = manifest.get("version")
    if type(version) is not int or manifest.get("algorithm") != ALGORITHM:
        raise IntegrityError(
            f"{where}: manifest version must be an integer and algorithm {ALGORITHM!r}. "
            f"Received version={version!r}, algorithm={manifest.get('algorithm')!r}",
            path=where,
        )
    if version > VERSION:
        raise IncompatibleFormatError(
            f"{where} was written with manifest version {version}, but this trainer reads "
            f"versions up to {VERSION}. Upgrade trainer to verify and load it. "
            f"Received version={version}"
        )
    files = manifest.get("files")
    if not isinstance(files, list):
        raise IntegrityError(
            f"{where}: the manifest's 'files' must be a list. Received: {_short(files)}",
            path=where,
        )
    for entry in files:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("path"), str)
            and type(entry.get("size")) is int
            and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str)
        ):
            raise IntegrityError(
                f"{where}: every manifest entry needs a string 'path', a non-negative "
                f"integer 'size' and a string 'sha256'. Received entry: {_short(entry)}",
                path=where,
            )
        safe_relative(entry["path"], where)


def safe_relative(name: str, where: Path) -> PurePosixPath:
    """``name`` as a path that stays inside the checkpoint (no ``..``, not absolute)."""
    pure = PurePosixPath(name)
    if (
        not name
        or pure.is_absolute()
        or "\\" in name
        or "\0" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise IntegrityError(
            f"{where}: the manifest names a file outside the checkpoint or with an unsafe "
            f"name; a trainer manifest only lists plain relative paths. Refusing to read it. "
            f"Received path {name!r}",
            path=where,
            file=name,
        )
    return pure


def verify_directory(
    directory: Path, relative: str = MANIFEST_FILE, *, digests: bool, strict: bool = False
) -> dict[str, Any] | None:
    """Check every listed file (and with ``strict``, that nothing unlisted was added).

    Returns the manifest, or None when the checkpoint has none (written before manifests).
    Raises ``IntegrityError`` naming the first bad file.
    """
    directory = Path(directory)
    manifest = read_manifest(directory, relative)
    if manifest is None:
        return None
    root = os.path.realpath(directory)
    for entry in manifest["files"]:
        _verify_entry(directory, root, entry, digests=digests)
    if strict:
        listed = {entry["path"] for entry in manifest["files"]} | {relative}
        for root_dir, dirs, names in os.walk(directory):
            _refuse_linked_directories(directory, root_dir, dirs)
            for name in sorted(names):
                rel = Path(root_dir, name).relative_to(directory).as_posix()
                if rel not in listed:
                    raise IntegrityError(
                        f"{directory}: file {rel!r} is not in the manifest; it was added "
                        f"after the checkpoint was written (or comes from another one). "
                        f"Remove it or restore the checkpoint from a copy. Received {rel!r}",
                        path=directory,
                        file=rel,
                    )
    return manifest


def _refuse_linked_directories(directory: Path, root_dir: str, dirs: list[str]) -> None:
    """``os.walk`` lists a symbolic link to a directory among the directories and never
    enters it: whatever it holds was not checked, so it is reported as added."""
    for name in sorted(dirs):
        if os.path.islink(os.path.join(root_dir, name)):
            rel = Path(root_dir, name).relative_to(directory).as_posix()
            raise IntegrityError(
                f"{directory}: {rel!r} is a symbolic link to a directory, which no checkpoint "
                f"holds; it was added after the checkpoint was written. Remove it. Received "
                f"link to {os.readlink(os.path.join(root_dir, name))!r}",
                path=directory,
                file=rel,
            )


def _verify_entry(directory: Path, root: str, entry: dict[str, Any], *, digests: bool) -> None:
    _check_file(directory, root, entry)
    if digests:
        _check_digest(directory, entry)


def _entry_error(directory: Path, name: str, problem: str, received: str) -> IntegrityError:
    return IntegrityError(
        f"{directory}: file {name!r} {problem}; the checkpoint is damaged or incomplete. "
        f"Load an older checkpoint, or restore this one from a copy. Received: {received}",
        path=directory,
        file=name,
    )


def _check_file(directory: Path, root: str, entry: dict[str, Any]) -> None:
    """The listed file is a regular file inside the checkpoint with its recorded size."""
    name = entry["path"]
    target = directory / name

    def fail(problem: str, received: str) -> IntegrityError:
        return _entry_error(directory, name, problem, received)

    try:
        info = os.lstat(target)
        inside = os.path.realpath(target).startswith(root + os.sep)
    except FileNotFoundError:
        raise fail("is missing", "no such file") from None
    except NotADirectoryError:
        raise fail("is missing: a file stands where a directory is expected", "ENOTDIR") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise fail("cannot be reached: its path has a symbolic-link loop", "ELOOP") from None
        raise fail(f"cannot be read ({error.strerror})", repr(error)) from error
    if not inside or stat.S_ISLNK(info.st_mode):
        raise fail("is a symbolic link or leads outside the checkpoint", str(target))
    if not stat.S_ISREG(info.st_mode):
        raise fail("is not a regular file", f"mode {stat.filemode(info.st_mode)}")
    if info.st_size != entry["size"]:
        raise fail(
            f"has {info.st_size} bytes instead of {entry['size']} (truncated or overwritten)",
            f"size {info.st_size}",
        )


def _check_digest(directory: Path, entry: dict[str, Any]) -> None:
    name = entry["path"]
    try:
        digest = file_digest(directory / name)
    except OSError as error:
        problem = f"cannot be read ({error.strerror})"
        raise _entry_error(directory, name, problem, repr(error)) from error
    if digest != entry["sha256"]:
        raise _entry_error(
            directory, name, "does not match its SHA-256 digest (content changed)", "another digest"
        )


# ------------------------------------------------------------------- checks on load
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
                    _check_file(directory, root, entry)
            for entry in entries:
                if arrival is None or not arrival.vouches(directory, entry):
                    _check_digest(directory, entry)
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
        _check_file(directory, root, entry)
        late_read = any(fnmatch(entry["path"], pattern) for pattern in late)
        (deferred if late_read and entry["size"] >= DEFER_FROM else now).append(entry)
    for entry in now:
        if arrival is None or not arrival.vouches(directory, entry):
            _check_digest(directory, entry)
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


def find_manifest(directory: Path) -> tuple[str, dict[str, Any]] | None:
    """The first manifest found at a known location, with its location, for diagnosis."""
    if not Path(directory).is_dir():
        return None
    for relative in KNOWN_LOCATIONS:
        manifest = read_manifest(directory, relative)
        if manifest is not None:
            return relative, manifest
    return None


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


def total_size(path: Path) -> int:
    """Bytes under ``path`` (a file or a directory), without following links."""
    path = Path(path)
    if not path.is_dir():
        return path.stat().st_size
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(root, name)).st_size
    return total


# ------------------------------------------------------------------ HDF5 user block
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
