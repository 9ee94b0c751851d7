"""How a finished checkpoint directory is flushed to disk before its rename."""

from __future__ import annotations

import os
import sys

import pytest

from trainer import atomic


def _tree(root):
    (root / "variables").mkdir(parents=True)
    (root / "saved_model.pb").write_bytes(b"graph")
    (root / "variables" / "variables.index").write_bytes(b"index")
    return root


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs(2) is Linux only")
def test_on_linux_a_directory_is_flushed_by_one_syncfs(tmp_path, monkeypatch):
    """The fast flush is the one taken on Linux: were libc's syncfs missing or refused,
    every save would fall back to per-file fsyncs without a word."""
    flushed = []
    monkeypatch.setattr(atomic, "_fsync_file", flushed.append)
    monkeypatch.setattr(atomic, "fsync_dir", flushed.append)
    assert atomic._syncfs(_tree(tmp_path / "ckpt")) is True
    atomic.fsync_tree(tmp_path / "ckpt")
    assert flushed == []


def test_without_syncfs_every_file_and_directory_is_fsynced(tmp_path, monkeypatch):
    root = _tree(tmp_path / "ckpt")
    flushed = []

    def recording(real):
        def flush(path):
            flushed.append(os.path.relpath(path, root))
            real(path)  # the real fsync still runs

        return flush

    monkeypatch.setattr(atomic, "_syncfs_call", lambda: None)
    monkeypatch.setattr(atomic, "_fsync_file", recording(atomic._fsync_file))
    monkeypatch.setattr(atomic, "fsync_dir", recording(atomic.fsync_dir))
    atomic.fsync_tree(root)
    assert sorted(flushed) == sorted(
        [".", "saved_model.pb", "variables", os.path.join("variables", "variables.index")]
    )
