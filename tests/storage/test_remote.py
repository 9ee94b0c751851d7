"""Checkpoints on object storage at the byte level (``trainer.storage.remote``), against a
real S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server.py``): publication by a
commit marker written last, ``latest``, retention's delete order, the verified local cache,
and one clear ``TrainerError`` line for each way a store can be misconfigured."""

from __future__ import annotations

import json

import pytest

from tests.helpers.s3_server import objects
from trainer.errors import IntegrityError, NotACheckpointError, StoreError, UnsupportedLocationError
from trainer.storage import integrity
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.store import Store


def _checkpoint(tmp_path, name: str, payload: bytes):
    """A local directory checkpoint with a trainer manifest, as a backend leaves it."""
    path = tmp_path / "staging" / name
    (path / "sub").mkdir(parents=True)
    (path / "weights.bin").write_bytes(payload)
    (path / "sub" / "meta.json").write_text(json.dumps({"n": len(payload)}))
    integrity.write_manifest(path, backend="test")
    return path


def test_published_checkpoint_round_trips_through_the_cache(s3_bucket, tmp_path):
    remote = RemoteCheckpoints(f"{s3_bucket}/run/checkpoints")
    local = _checkpoint(tmp_path, "ckpt-1", b"\x01" * 5000)
    remote.publish(local, step=1)
    remote.point_latest("ckpt-1")
    fetched = remote.fetch("latest")
    assert fetched.name == "ckpt-1"
    for file in ("weights.bin", "sub/meta.json", integrity.MANIFEST_FILE):
        assert (fetched / file).read_bytes() == (local / file).read_bytes()
    integrity.verify_directory(fetched, digests=True, strict=True)
    assert remote.fetch("ckpt-1") == fetched  # the cache entry is reused
