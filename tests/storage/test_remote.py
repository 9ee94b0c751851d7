"""Checkpoints on object storage at the byte level (``trainer.storage.remote``), against a
real S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server.py``): publication by a
commit marker written last, ``latest``, retention's delete order, the verified local cache,
and one clear ``TrainerError`` line for each way a store can be misconfigured."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.s3_server import objects
from trainer.errors import IntegrityError, NotACheckpointError, StoreError, UnsupportedLocationError
from trainer.storage import integrity, store
from trainer.storage.early import EarlyUploads
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


def test_objects_without_a_marker_are_never_listed_or_loaded(s3_bucket, tmp_path):
    """An upload cut short (every object written, the marker not yet) is invisible."""
    url = f"{s3_bucket}/run/checkpoints"
    remote = RemoteCheckpoints(url)
    remote.publish(_checkpoint(tmp_path, "ckpt-1", b"a" * 100), step=1)
    partial = _checkpoint(tmp_path, "ckpt-2", b"b" * 100)
    store = Store(url)
    for file in ("weights.bin", "sub/meta.json", integrity.MANIFEST_FILE):
        store.put_file(partial / file, f"ckpt-2/{file}")
    store.put_bytes("latest", b"ckpt-2")  # even a latest pointing at it
    assert [m["name"] for m in remote.committed()] == ["ckpt-1"]
    assert remote.read_latest() == "ckpt-1"
    with pytest.raises(NotACheckpointError, match="no commit marker"):
        remote.fetch("ckpt-2")
    assert remote.fetch("latest").name == "ckpt-1"


def test_markers_order_by_step_and_latest_is_one_object(s3_bucket, tmp_path):
    remote = RemoteCheckpoints(f"{s3_bucket}/ckpts")
    for step, name in ((30, "c"), (10, "a"), (20, "b")):
        remote.publish(_checkpoint(tmp_path, name, bytes([step]) * 10), step=step)
        remote.point_latest(name)
    assert [m["name"] for m in remote.committed()] == ["a", "b", "c"]
    assert remote.read_latest() == "b"  # the last written, whatever its step
    assert Store(remote.url).get_bytes("latest") == b"b"


def test_delete_removes_the_marker_before_the_objects(s3_bucket, s3_server, tmp_path):
    """A kill between the two steps of a delete leaves objects without a marker (ignored),
    never a marker naming missing objects: the state after the first step is listed as
    nothing, and a whole delete leaves nothing at all."""
    url = f"{s3_bucket}/ckpts"
    remote = RemoteCheckpoints(url)
    for step in (1, 2):
        remote.publish(_checkpoint(tmp_path, f"ckpt-{step}", b"x" * 64), step=step)
    Store(url).delete([".commits/ckpt-1.json"])  # the first step of delete("ckpt-1") only
    assert [m["name"] for m in remote.committed()] == ["ckpt-2"]
    assert any(key.startswith("ckpt-1/") for key in objects(s3_server, url))
    assert remote.delete("ckpt-2") is True
    assert not any(
        key.startswith(("ckpt-2/", ".commits/ckpt-2")) for key in objects(s3_server, url)
    )


def test_republishing_a_name_never_mixes_old_and_new_objects(s3_bucket, s3_server, tmp_path):
    remote = RemoteCheckpoints(f"{s3_bucket}/ckpts")
    old = _checkpoint(tmp_path / "old", "ckpt", b"o" * 50)
    (old / "only-old.bin").write_bytes(b"stale")
    remote.publish(old, step=1)
    remote.publish(_checkpoint(tmp_path / "new", "ckpt", b"n" * 70), step=2)
    assert "ckpt/only-old.bin" not in objects(s3_server, remote.url)
    fetched = remote.fetch("ckpt")
    assert (fetched / "weights.bin").read_bytes() == b"n" * 70


def test_an_object_changed_after_publication_fails_the_fetch(s3_bucket, tmp_path):
    remote = RemoteCheckpoints(f"{s3_bucket}/ckpts")
    remote.publish(_checkpoint(tmp_path, "ckpt-1", b"g" * 80), step=1)
    Store(remote.url).put_bytes("ckpt-1/weights.bin", b"h" * 80)
    with pytest.raises(IntegrityError, match="differs from its commit marker"):
        remote.fetch("ckpt-1")


def test_the_cache_stays_within_its_bound(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_STORE_CACHE_BYTES", "6000")
    remote = RemoteCheckpoints(f"{s3_bucket}/ckpts")
    for step in (1, 2):
        remote.publish(_checkpoint(tmp_path, f"ckpt-{step}", bytes([step]) * 4000), step=step)
    first = remote.fetch("ckpt-1")
    second = remote.fetch("ckpt-2")
    assert second.is_dir() and not first.exists()  # least recently used went


# ----------------------------------------------------------------------- bad input
def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "Received:" in text
    return text


def test_unknown_scheme_is_refused(s3_bucket):
    with pytest.raises(UnsupportedLocationError) as error:
        RemoteCheckpoints("az://bucket/x")
    assert "s3://" in _one_line(error)


def test_missing_bucket_is_named(s3_bucket):
    remote = RemoteCheckpoints("s3://no-such-bucket-here/run")
    with pytest.raises(StoreError) as error:
        remote.committed()
    assert "'no-such-bucket-here' of s3://no-such-bucket-here/run does not exist" in _one_line(
        error
    )


def test_wrong_credentials_are_named(s3_bucket, s3_server):
    remote = RemoteCheckpoints(f"{s3_bucket}/ckpts")
    with s3_server.checking_credentials(), pytest.raises(StoreError) as error:
        remote.committed()
    assert "credentials were refused" in _one_line(error)


def test_unreachable_endpoint_is_named(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreError) as error:
        RemoteCheckpoints(f"{s3_bucket}/ckpts").committed()
    assert "could not be reached at endpoint http://127.0.0.1:9" in _one_line(error)


def test_a_url_without_the_s3_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if not installed: import fails
    monkeypatch.setattr(store, "_filesystems", {})
    with pytest.raises(UnsupportedLocationError) as error:
        Store("s3://bucket/x")
    assert 'pip install "trainer[s3]"' in _one_line(error)


def test_an_exclusive_put_creates_only_once(s3_bucket):
    """``If-None-Match: *`` reaches the server: the second create of a key is refused
    (the building block of a lease; S3 and S3-compatible servers honour it)."""
    store = Store(f"{s3_bucket}/x")
    assert store.put_bytes("lease", b"first", exclusive=True) is True
    assert store.put_bytes("lease", b"second", exclusive=True) is False
    assert store.get_bytes("lease") == b"first"


def test_a_savedmodel_checkpoint_changed_before_its_upload_is_refused_at_download(
    s3_bucket, tmp_path
):
    """The marker of a savedmodel checkpoint takes every file's digest from its manifest
    (in ``assets.extra/``) instead of hashing the files again: a staged file changed
    after the backend wrote it (same size) is refused when downloaded, by the cache's
    check against the marker, before any backend reads it."""
    import keras

    from trainer.save_backends import get_backend

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    local = tmp_path / "staging" / "ckpt-1"
    get_backend("savedmodel").save(model, local)
    assert integrity.find_manifest(local)[0] == f"assets.extra/{integrity.MANIFEST_FILE}"
    data = local / "variables" / "variables.data-00000-of-00001"
    content = bytearray(data.read_bytes())
    content[-1] ^= 0xFF
    data.write_bytes(bytes(content))
    remote = RemoteCheckpoints(f"{s3_bucket}/run/checkpoints")
    marker = remote.publish(local, step=1)
    manifest = integrity.find_manifest(local)[1]
    assert {e["path"]: e["sha256"] for e in manifest["files"]}.items() <= {
        e["path"]: e["sha256"] for e in marker["objects"]
    }.items()
    with pytest.raises(IntegrityError, match="differs from its commit marker"):
        remote.fetch("ckpt-1")


def test_an_early_object_the_manifest_does_not_match_is_uploaded_again(s3_bucket, tmp_path):
    """``publish`` reuses a file uploaded during the local write (``EarlyUploads``) only
    where the manifest records the size and digest the early upload announced; another
    one is uploaded again, so the marker never names bytes the store does not hold."""
    path = _checkpoint(tmp_path, "ckpt", b"the final bytes")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"stale")
    remote = RemoteCheckpoints(f"{s3_bucket}/c")
    begun = remote.begin_in_background("ckpt")
    early = EarlyUploads(remote.store, "ckpt", begun)
    early.add(elsewhere, "weights.bin", *integrity.known_digest(b"stale"))
    assert early.finish() == {"weights.bin": integrity.known_digest(b"stale")}
    assert remote.store.get_bytes("ckpt/weights.bin") == b"stale"  # uploaded early
    remote.publish(path, step=1, begun=begun, early=early)
    assert remote.store.get_bytes("ckpt/weights.bin") == b"the final bytes"
    assert (remote.fetch("ckpt") / "weights.bin").read_bytes() == b"the final bytes"
