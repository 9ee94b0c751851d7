"""``train(cfg)`` with ``run_dir=s3://...`` puts its serving export and TensorBoard log on
the store (``trainer.training.store_sync``), against a real S3-compatible server on
127.0.0.1 (``tests/helpers/s3_server``)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.s3_server import objects
from trainer import train
from trainer.cli.app import main as cli_main
from trainer.errors import StoreError, TrainerError
from trainer.storage.remote import RemoteCheckpoints
from trainer.training.remote_run import mirror_dir
from trainer.training.store_sync import EventSync, publish_export

RUN = [
    "model=mlp",
    "save=weights",
    "trainer.epochs=1",
    "export.enabled=true",
    "export.warmup_examples=0",
]


def _events(keys: list[str]) -> list[str]:
    return sorted(k for k in keys if "tfevents" in k.rsplit("/", 1)[-1])


def _serve(directory, x) -> np.ndarray:
    serving = tf.saved_model.load(str(directory)).signatures["serving_default"]
    return next(iter(serving(tf.constant(x)).values())).numpy()


def test_the_export_and_the_event_files_are_on_the_store(
    compose_cfg, s3_bucket, s3_server, tmp_path
):
    """After ``train``: the export under ``export/1/`` with its marker written after its
    objects and ``latest``, which ``trainer verify`` checks; downloaded, it serves what
    the local export serves; every event file of the local log is on the store byte for
    byte. A resumed session on another machine (an empty mirror) adds its event files
    beside the first session's and publishes its export as version 2, not over version 1."""
    url = f"{s3_bucket}/run"
    train(compose_cfg(*RUN, f"run_dir={url}"))
    mirror = mirror_dir(url)
    keys = objects(s3_server, url)

    local_export = mirror / "export" / "1"
    exported = sorted(
        p.relative_to(local_export).as_posix() for p in local_export.rglob("*") if p.is_file()
    )
    assert [k[len("export/1/") :] for k in keys if k.startswith("export/1/")] == exported
    assert "saved_model.pb" in exported
    marker = RemoteCheckpoints(f"{url}/export").marker("1")
    assert marker is not None and sorted(o["path"] for o in marker["objects"]) == exported
    assert s3_server.fs.cat_file(f"{url[5:]}/export/latest") == b"1"
    assert cli_main(["verify", f"{url}/export/latest"]) == 0  # fetched, checked whole

    downloaded = tmp_path / "downloaded"
    s3_server.fs.get(f"{url[5:]}/export/1/", str(downloaded), recursive=True)
    signature = tf.saved_model.load(str(local_export)).signatures["serving_default"]
    spec = next(iter(signature.structured_input_signature[1].values()))
    shape = [3 if d is None else d for d in spec.shape]
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    np.testing.assert_array_equal(_serve(downloaded, x), _serve(local_export, x))

    local_events = sorted(
        p.relative_to(mirror).as_posix() for p in (mirror / "tb").rglob("*tfevents*")
    )
    assert local_events and _events(keys) == local_events
    for key in local_events:
        assert s3_server.fs.cat_file(f"{url[5:]}/{key}") == (mirror / key).read_bytes()

    shutil.rmtree(mirror)  # the next session runs on a machine without the first's files
    train(compose_cfg(*RUN, f"run_dir={url}", "resume=auto", "trainer.epochs=2"))
    keys_after = objects(s3_server, url)
    assert set(local_events) < set(_events(keys_after))  # the first session's stay
    assert sorted(m["name"] for m in RemoteCheckpoints(f"{url}/export").committed()) == ["1", "2"]
    assert s3_server.fs.cat_file(f"{url[5:]}/export/latest") == b"2"
    assert marker == RemoteCheckpoints(f"{url}/export").marker("1")  # not replaced

    # A finished run whose export never reached the store (stopped before the upload):
    # re-running it publishes the local export, and only once.
    s3_server.fs.rm(f"{url[5:]}/export", recursive=True)
    for _ in range(2):
        train(compose_cfg(*RUN, f"run_dir={url}", "resume=auto", "trainer.epochs=2"))
        found = RemoteCheckpoints(f"{url}/export").committed()
        assert [(m["name"], m["step"]) for m in found] == [("1", marker["step"] * 2)]


def test_a_failed_upload_is_one_store_error(s3_bucket, s3_server, tmp_path):
    """Refused credentials during the export or event upload: one ``StoreError`` (a
    ``TrainerError``) naming the object, and no export marker on the store."""
    version = tmp_path / "export" / "1"
    version.mkdir(parents=True)
    (version / "saved_model.pb").write_bytes(b"graph")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1.host.2.3").write_bytes(b"events")
    with s3_server.checking_credentials():
        with pytest.raises(StoreError, match="credentials were refused") as error:
            publish_export(f"{s3_bucket}/run/export", version, step=1, keep=5)
        assert isinstance(error.value, TrainerError)
        with pytest.raises(StoreError, match=r"run/tb/events\.out\.tfevents"):
            EventSync(f"{s3_bucket}/run/tb", tmp_path / "tb")()
    assert objects(s3_server, f"{s3_bucket}/run") == []


def test_export_versions_beyond_keep_leave_the_store(s3_bucket, s3_server, tmp_path):
    """``export.keep`` on the store: the oldest versions go, marker and objects."""
    url = f"{s3_bucket}/run"
    for n in (1, 2, 3):
        version = tmp_path / "export" / str(n)
        (version / "variables").mkdir(parents=True)
        (version / "saved_model.pb").write_bytes(b"graph %d" % n)
        (version / "variables" / "variables.index").write_bytes(b"index")
        publish_export(f"{url}/export", version, step=n, keep=2)
    remote = RemoteCheckpoints(f"{url}/export")
    assert [m["name"] for m in remote.committed()] == ["2", "3"]
    assert not [k for k in objects(s3_server, f"{url}/export") if k.startswith("1/")]
    assert s3_server.fs.cat_file(f"{url[5:]}/export/3/saved_model.pb") == b"graph 3"
