"""How a finished checkpoint directory is flushed to disk before its rename."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest

from trainer.checkpointing.snapshot import AsyncWriter
from trainer.storage import atomic


def _tree(root):
    (root / "variables").mkdir(parents=True)
    (root / "saved_model.pb").write_bytes(b"graph")
    (root / "variables" / "variables.index").write_bytes(b"index")
    return root


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs(2) is Linux only")
def test_the_async_writer_flushes_a_directory_by_one_syncfs_others_file_by_file(
    tmp_path, monkeypatch
):
    """The fast flush is the one the async writer takes on Linux: were libc's syncfs
    missing or refused, every background save would fall back to per-file fsyncs without
    a word. A save in any other thread flushes its own files only."""
    flushed = []
    monkeypatch.setattr(atomic, "fsync_path", flushed.append)
    root = _tree(tmp_path / "ckpt")
    assert atomic._syncfs(root) is True
    writer = AsyncWriter()
    writer.submit(lambda: atomic.fsync_tree(root))
    writer.wait()
    assert flushed == []
    atomic.fsync_tree(root)
    assert len(flushed) == 4  # two files, two directories


def test_without_syncfs_every_file_and_directory_is_fsynced(tmp_path, monkeypatch):
    root = _tree(tmp_path / "ckpt")
    flushed = []

    def recording(real):
        def flush(path):
            flushed.append(os.path.relpath(path, root))
            real(path)  # the real fsync still runs

        return flush

    monkeypatch.setattr(atomic, "_syncfs_call", lambda: None)
    monkeypatch.setattr(atomic, "fsync_path", recording(atomic.fsync_path))
    atomic.fsync_tree(root)
    assert sorted(flushed) == sorted(
        [".", "saved_model.pb", "variables", os.path.join("variables", "variables.index")]
    )


def test_one_thread_serves_every_write_of_a_writer_and_ends_with_it():
    """The writes of one writer share one long-lived thread (not one thread per save); a
    failed write is raised by ``wait`` and the thread goes on serving; collecting the
    writer ends its thread."""
    writer = AsyncWriter()
    seen = []

    def record():
        seen.append(threading.get_native_id())

    for _ in range(3):
        writer.submit(record)
        writer.wait()
    assert len(set(seen)) == 1 and seen[0] != threading.get_native_id()
    writer.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writer.wait()
    writer.submit(record)
    writer.wait()
    assert seen[-1] == seen[0]
    if sys.platform.startswith("linux"):
        task = f"/proc/self/task/{seen[0]}"
        assert os.path.exists(task)
        del writer
        gc.collect()
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(task)
