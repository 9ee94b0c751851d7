"""Who uses a directory: one writing process per run directory, and readers' leases.

* ``DirectoryLock``: a training process holds its run directory's lock for as long as it
  writes there, so a second training started on the same directory is refused at once
  ("in use by PID N on host H") instead of deleting the first one's temporaries and mixing
  checkpoints and TensorBoard curves. It is a kernel ``flock`` on a small hidden file: the
  kernel drops it when the process dies, so a crashed run never leaves a stale lock.
* Read leases: a reader loading a checkpoint of a managed directory (one with a ``latest``
  link) drops a hidden ``.reading-<name>.<pid>-<id>`` file beside it for the duration of the
  read, and retention (``remove_unless_read``) defers deleting a checkpoint that has a live
  lease. Without them a reader slower than the writer's checkpoint interval could see every
  checkpoint it starts reading deleted under it, however often it retried.

The lease protocol needs no shared clock: the reader creates its lease, *then* checks the
checkpoint still exists; the writer renames the checkpoint away, *then* checks for leases
and renames it back if one appeared. Whichever order the two run in, either the reader sees
the checkpoint gone (and reads the newer one ``latest`` points at) or the writer sees the
lease (and keeps the checkpoint for a later retention pass).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from trainer.errors import DirectoryInUseError
from trainer.storage.atomic import process_alive, remove_path, temporary_sibling

LOCK_NAME = ".trainer.lock"
LEASE_PREFIX = ".reading-"
LATEST = "latest"  # the link a managed checkpoint directory keeps to its newest checkpoint
"""Name of the symlink a checkpoint directory keeps to its newest checkpoint."""
_LEASE_SUFFIX = re.compile(r"\.(\d+)-[0-9a-f]{8}$")

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None


class DirectoryLock:
    """An exclusive, non-blocking lock of ``directory`` for one writing process."""

    def __init__(self, directory: str | os.PathLike, purpose: str = "training"):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.purpose = purpose
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        if self._fd is not None or fcntl is None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise self._in_use() from None
            if self._still_named(fd):
                self._fd = fd
            else:  # locked a file its holder removed on release: lock the new one
                os.close(fd)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(owner).encode(), 0)
        return self

    def _still_named(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Remove the file while still holding it, then unlock: a process that opened the
        old file before the removal sees it is no longer named and retries (``acquire``)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _in_use(self) -> DirectoryInUseError:
        try:
            owner = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            owner = {}
        who = f"PID {owner.get('pid', '?')} on host {owner.get('host', '?')}"
        return DirectoryInUseError(
            f"{self.directory} is in use by {who} ({owner.get('purpose', 'another process')}); "
            f"two processes writing one run directory would delete each other's checkpoints "
            f"and mix their TensorBoard curves. Wait for it to finish, stop it, or write to "
            f"another directory (hydra.run.dir=... or run_dir=...). Received: {str(self.path)!r}"
        )

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------- leases
def is_managed(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` sits in a directory a writer prunes (it keeps ``latest``)."""
    return (checkpoint.parent / LATEST).is_symlink()


@contextlib.contextmanager
def read_lease(checkpoint: Path) -> Iterator[bool]:
    """Hold a lease on ``checkpoint`` while reading it; yields whether one is held (not in
    an unmanaged directory, nor where the reader may not write: a read-only copy has no
    writer to defer)."""
    if not is_managed(checkpoint):
        yield False
        return
    owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lease = checkpoint.parent / f"{LEASE_PREFIX}{checkpoint.name}.{owner}"
    try:
        fd = os.open(lease, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        yield False
        return
    try:
        os.write(fd, socket.gethostname().encode())
    finally:
        os.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            lease.unlink()


def is_read(checkpoint: Path) -> bool:
    """Whether a live reader holds a lease on ``checkpoint``; removes leases of readers that
    died on this host. A lease from another host counts as live (its PID cannot be checked)."""
    prefix = f"{LEASE_PREFIX}{checkpoint.name}."
    try:
        names = [n for n in os.listdir(checkpoint.parent) if n.startswith(prefix)]
    except OSError:
        return False
    for name in names:
        match = _LEASE_SUFFIX.search(name)
        if match is None or match.start() != len(prefix) - 1:
            continue  # a lease of a longer checkpoint name that starts with this one
        if _check_lease(checkpoint.parent / name, int(match.group(1))):
            return True
    return False


def remove_dead_leases(directory: Path) -> list[Path]:
    """Remove the leases in ``directory`` of readers on this host that died (killed while
    reading a checkpoint); returns them. Retention removes such a lease when it wants that
    checkpoint gone, but the newest checkpoint, read by every resume, is never pruned: its
    dead leases stayed behind for good (a crash test found one)."""
    removed = []
    with contextlib.suppress(OSError):
        for lease in directory.iterdir():
            match = _LEASE_SUFFIX.search(lease.name)
            if not lease.name.startswith(LEASE_PREFIX) or match is None:
                continue
            if _check_lease(lease, int(match.group(1))) is False:
                removed.append(lease)
    return removed


def _check_lease(lease: Path, pid: int) -> bool | None:
    """True if a live reader holds ``lease`` (a reader on another host counts as live: its
    PID cannot be checked); False if its reader died on this host, the lease now removed;
    None if it was released meanwhile."""
    try:
        lease_host = lease.read_text()
    except OSError:
        return None
    if lease_host == socket.gethostname() and not process_alive(pid):
        with contextlib.suppress(OSError):
            lease.unlink()
        return False
    return True


def remove_unless_read(checkpoint: Path) -> bool:
    """Delete ``checkpoint`` atomically (renamed to a hidden temporary, then removed) unless
    a reader holds a lease on it; returns whether it is gone (False: retry later)."""
    if is_read(checkpoint):
        return False
    trash = temporary_sibling(checkpoint)
    try:
        os.rename(checkpoint, trash)
    except FileNotFoundError:
        return True
    if is_read(checkpoint):  # a reader leased it before our rename: put it back
        os.rename(trash, checkpoint)
        return False
    remove_path(trash)
    return True
