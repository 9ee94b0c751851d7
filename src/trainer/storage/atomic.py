"""Atomic publication of files and directories.

A checkpoint is written into a hidden temporary sibling, flushed to disk, and only then
renamed to its final name, so a reader never sees a half-written checkpoint under a real
name (the same idea as orbax's atomic rename and TF Serving's version directories).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from trainer.errors import DiskFullError, SaveIOError, SavePermissionError

TMP_MARKER = ".tmp-"


def temporary_sibling(final: Path) -> Path:
    """A hidden name next to ``final`` that no listing mistakes for a checkpoint."""
    return final.with_name(f".{final.name}{TMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def first_unused(path_for: Callable[[int], Path]) -> Path:
    """``path_for(n)`` for the smallest ``n`` from 1 that names nothing yet: where what a
    run sets aside goes (``abandoned-<n>``), beside what it set aside before."""
    number = 1
    while path_for(number).exists():
        number += 1
    return path_for(number)


def is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and TMP_MARKER in path.name


_FLUSH = threading.local()


@contextlib.contextmanager
def flushing_whole_filesystem() -> Iterator[None]:
    """In this thread, ``fsync_tree`` flushes a directory with one ``syncfs(2)`` of its
    filesystem (Linux): every file and directory entry written into it reaches the disk
    in one journal commit instead of one per file, which halves the CPU of the flush for
    a repeat savedmodel save (about 0.45 ms of 3.6, ``benchmarks/analysis.md``). But it
    also waits for everything else dirty on that filesystem (96 MiB written by another
    program add 31 ms to a large save), so only the async writer thread asks for it: a
    save the training loop waits for flushes its own files only."""
    previous = getattr(_FLUSH, "filesystem", False)
    _FLUSH.filesystem = True
    try:
        yield
    finally:
        _FLUSH.filesystem = previous


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` (or the file itself) and the directories holding
    them: each one fsynced, or, in a thread that asked for it and where the call exists,
    one ``syncfs`` (``flushing_whole_filesystem``)."""
    if path.is_file():
        fsync_path(path)
        return
    if getattr(_FLUSH, "filesystem", False) and _syncfs(path):
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _syncfs(path: str | os.PathLike) -> bool:
    """``syncfs(2)`` on the filesystem holding ``path``; False where it does not exist."""
    call = _syncfs_call()
    if call is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if call(fd) == 0:
            return True
        code = ctypes.get_errno()
    finally:
        os.close(fd)
    if code in (errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(path))


@functools.cache
def _syncfs_call() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # a libc without it (glibc < 2.14, some musl)
        return None


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's content, or a directory's entries (a rename or a new file in it), to
    disk. No Python file object: every save flushes each of its files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_atomically(path: Path) -> Path | None:
    """Delete a published ``path`` so that no half-deleted copy ever keeps its real name:
    rename it to a hidden temporary sibling first (one atomic step), then remove that. A
    crash in between leaves only a temporary, which ``clean_stale_temporaries`` removes.
    Returns the temporary it was moved to (already removed), or None if it did not exist."""
    trash = temporary_sibling(path)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return None
    remove_path(trash)
    return trash


def remove_path(path: Path) -> None:
    """Remove a file, link or directory tree in place (for temporaries, never for a
    published name: see ``remove_atomically``)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_write(final: Path, *, directory: bool) -> Iterator[Path]:
    """Yield a temporary path to write into; publish it as ``final`` only on success.

    On any exception the temporary is removed and ``final`` (if it existed) is untouched.
    """
    final = Path(final)
    if not final.parent.is_dir():  # a stat: a failing mkdir raises and catches an error
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(final)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        _replace(tmp, final)
    except BaseException:
        remove_path(tmp)
        raise
    fsync_path(final.parent)


def _replace(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` onto ``final``; an existing directory is moved aside first."""
    if final.is_dir() and not final.is_symlink():
        trash = temporary_sibling(final)
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


def clean_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries left by a crashed writer; returns what was removed.

    A temporary whose writer (the PID in its name) is another live process is kept: that
    writer is still working on it. This process's own are stale by definition here (its
    callers clean before they write).
    """
    removed = []
    if directory.is_dir():
        for child in directory.iterdir():
            if is_temporary(child) and not _written_by_another_live_process(child):
                remove_path(child)
                removed.append(child)
    return removed


def _written_by_another_live_process(path: Path) -> bool:
    """Every PID the name records counts (``.NAME.tmp-PID-ID``; older versions doubled it)."""
    owners = {int(pid) for pid in re.findall(r"\.tmp-([0-9]+)-", path.name)} - {0, os.getpid()}
    return any(map(process_alive, owners))


def process_alive(pid: int) -> bool:
    """Whether a process with ``pid`` runs on this host (signal 0 checks, sends nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to another user
        return True
    return True


_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


def write_error(final: Path, error: BaseException) -> SaveIOError:
    """The ``SaveError`` for a save of ``final`` that failed with ``error`` (OSError or a
    TensorFlow I/O error, which carries no errno but the OS message)."""
    code = getattr(error, "errno", None)
    text = str(error)
    wrapped = _classify(final, code, text, type(error).__name__)
    wrapped.errno = code
    return wrapped


def _classify(final: Path, code: int | None, text: str, kind: str) -> SaveIOError:
    where = (
        f"The previous checkpoints in {Path(final).parent} are intact and the partial "
        f"write was removed."
    )
    if code in _FULL or any(s in text for s in ("No space left", "File too large", "quota")):
        return DiskFullError(
            f"Saving {final} failed: the disk is full or a file-size limit was reached. "
            f"{where} Free space (or lower checkpoint.policy.keep_last) and save again. "
            f"Received error type {kind}: {text}"
        )
    if code in _DENIED or any(s in text for s in ("Permission denied", "Read-only file")):
        return SavePermissionError(
            f"Saving {final} failed: writing there is not permitted. {where} Fix the "
            f"directory's permissions or choose another run directory. "
            f"Received error type {kind}: {text}"
        )
    return SaveIOError(
        f"Saving {final} failed while writing. {where} Check the disk and the path. "
        f"Received error type {kind}: {text}"
    )
