"""Write a large new file around the page cache (``O_DIRECT``), hashing it on the way.

Why: on the machines this project is measured on (a Firecracker VM that hands unused guest
memory back to its host), a write through the page cache into pages the kernel must newly
allocate costs about 2 ms per MiB: 97 MiB of a large model's variables took 0.2-0.3 s
that way, against 0.04 s into pages a deletion had just freed and 0.03 s written with
``O_DIRECT`` (``benchmarks/page_cache.py``). A checkpoint is not read back by the
process that writes it, so keeping its bytes in the cache buys nothing; DeepSpeed's
FastPersist writes its checkpoints with ``O_DIRECT`` for the same reason.

``O_DIRECT`` wants the buffer, the file offset and the length aligned to the device's
block. Bytes are therefore copied into page-aligned staging buffers and written in whole
chunks; the last chunk is padded to the alignment and the file truncated back to its true
size. A filesystem that refuses ``O_DIRECT`` (tmpfs, some network filesystems) gets the
same bytes through an ordinary write. A second thread hashes each chunk (SHA-256, for the
checkpoint's manifest, so the file is never read back to be hashed) and writes it while
the caller fills the next; both release the GIL.

Durability is the caller's: ``O_DIRECT`` bypasses the cache, not the disk's own write
cache, so the directory is still fsynced before it is published (``atomic.fsync_tree``).
``TRAINER_BUFFERED_WRITES=1`` turns ``O_DIRECT`` off (an escape hatch for a filesystem
that accepts the flag but misbehaves with it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK = 4 << 20  # bytes per staging buffer and per write
ALIGNMENT = 4096  # covers 512-byte and 4 KiB logical blocks
BUFFERED_ENV = "TRAINER_BUFFERED_WRITES"

_POOL_LOCK = threading.Lock()
_POOL: list[mmap.mmap] = []  # staging buffers kept between writes: fresh pages cost here


def _take_buffer() -> mmap.mmap:
    with _POOL_LOCK:
        if _POOL:
            return _POOL.pop()
    return mmap.mmap(-1, CHUNK)  # anonymous: page-aligned


def _give_back(buffer: mmap.mmap) -> None:
    with _POOL_LOCK:
        if len(_POOL) < 4:  # two writers at once at most (a sync save beside an async one)
            _POOL.append(buffer)
            return
    buffer.close()


def direct_wanted() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get(BUFFERED_ENV, "") in ("", "0")


class StreamedFile:
    """A new file at ``path`` written in order by ``write`` and finished by ``close``,
    which returns its size and SHA-256 hex digest. ``abort`` closes it after an error
    (the caller removes the half-written file with the directory it is building)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        if direct_wanted():
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as error:
                if error.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
        if not self.direct:
            self._fd = os.open(self.path, flags, 0o644)
        self._bypassing = self.direct  # until a write falls back (``_stop_bypassing``)
        self._hash = hashlib.sha256()
        self._buffers = [_take_buffer(), _take_buffer()]
        self._view = memoryview(self._buffers[0])
        self._filled = 0
        self._size = 0
        self._worker: ThreadPoolExecutor | None = None  # from the second chunk on
        self._pending: Future[None] | None = None

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` (any C-contiguous buffer; copied into staging at once)."""
        source = memoryview(data).cast("B")
        offset, total = 0, len(source)
        while offset < total:
            count = min(total - offset, CHUNK - self._filled)
            self._view[self._filled : self._filled + count] = source[offset : offset + count]
            self._filled += count
            offset += count
            if self._filled == CHUNK:
                self._hand_over()
        self._size += total

    def _hand_over(self) -> None:
        """Queue the full part of the current buffer; continue in the other one."""
        if self._pending is not None:
            self._pending.result()  # the other buffer is free again
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="trainer-direct-write")
        buffer, length = self._buffers[0], self._filled
        self._pending = self._worker.submit(self._write_chunk, buffer, length)
        self._buffers.reverse()
        self._view.release()
        self._view = memoryview(self._buffers[0])
        self._filled = 0

    def _write_chunk(self, buffer: mmap.mmap, length: int) -> None:
        with memoryview(buffer) as view:
            self._hash.update(view[:length])
            end = length
            if self.direct and length % ALIGNMENT:
                end = length + ALIGNMENT - length % ALIGNMENT
                view[length:end] = bytes(end - length)  # the padding truncated away below
            written = 0
            while written < end:
                try:
                    count = os.write(self._fd, view[written:end])
                except OSError as error:
                    if error.errno != errno.EINVAL or not self._bypassing:
                        raise
                    self._stop_bypassing()
                    continue  # the same bytes again, through the page cache
                written += count
                if count and written % ALIGNMENT and written < end:
                    self._stop_bypassing()  # a short write: the rest is not aligned

    def _stop_bypassing(self) -> None:
        """Write the rest through the page cache. Near a file-size limit or a full disk
        an ``O_DIRECT`` write fails with EINVAL (the part that fits is not aligned) or is
        cut short (then the rest is not aligned): an ordinary write reports the real
        error (EFBIG, ENOSPC), which the save turns into its message. A device whose
        blocks are larger than ``ALIGNMENT`` ends here too, and is simply written."""
        self._bypassing = False
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)

    def close(self) -> tuple[int, str]:
        try:
            if self._pending is not None:
                self._pending.result()
                self._pending = None
            if self._filled:  # the last chunk: nothing left to overlap it with
                self._write_chunk(self._buffers[0], self._filled)
            if self.direct and self._size % ALIGNMENT:
                os.ftruncate(self._fd, self._size)
        finally:
            self._release()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(OSError):  # what made the caller abort, or its echo
                self._pending.result()
        self._release()

    def _release(self) -> None:
        if self._fd < 0:
            return
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._view.release()
        for buffer in self._buffers:
            _give_back(buffer)
        self._buffers = []
        os.close(self._fd)
        self._fd = -1
