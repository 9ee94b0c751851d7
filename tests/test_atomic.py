"""How a finished checkpoint directory is flushed to disk before its rename."""

from __future__ import annotations

import os
import sys

import pytest

from trainer import atomic
from trainer.checkpointing.snapshot import AsyncWriter


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
