"""``trainer inspect`` and ``trainer verify`` on an ``s3://`` checkpoint URL, against a real
S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server.py``): the checkpoint is
fetched through the verified cache, then described or verified as a local one; a damaged
object on the store is one error line and exit 2."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from tests.helpers.s3_server import objects
from trainer.checkpointing import CheckpointManager
from trainer.cli.app import main as cli_main
from trainer.state import TrainingState
from trainer.storage.remote import RemoteCheckpoints


@pytest.fixture
def saved(s3_bucket, tmp_path) -> str:
    """A weights checkpoint at step 7 on the store; returns its directory's URL."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head")])
    model.compile("sgd", "mse")
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    url = f"{s3_bucket}/run/checkpoints"
    with CheckpointManager(url, "weights", staging=tmp_path / "staging") as manager:
        manager.save(model, TrainingState(global_step=7), wait=True)
    return url


def test_inspect_and_verify_a_checkpoint_url(saved, capsys):
    assert cli_main(["inspect", f"{saved}/latest", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "weights" and report["global_step"] == 7
    assert cli_main(["verify", f"{saved}/step-00000007", "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert verified["backend"] == "weights" and verified["files"] > 0


def test_verify_names_an_object_damaged_on_the_store(saved, s3_server, capsys):
    key = f"{saved[len('s3://') :]}/step-00000007/model.weights.h5"
    data = bytearray(s3_server.fs.cat_file(key))
    data[-1] ^= 0xFF
    s3_server.fs.pipe_file(key, bytes(data))
    assert cli_main(["verify", f"{saved}/latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "model.weights.h5" in err and len(err.splitlines()) == 1


def test_an_unsupported_scheme_is_one_error_line(capsys):
    assert cli_main(["inspect", "az://bucket/run/checkpoints/latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "az:// is not supported" in err


def _checkpoints(url: str, steps: list[int], staging) -> None:
    """Weights checkpoints of a small model at ``steps`` in the directory ``url``."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    with CheckpointManager(url, "weights", staging=staging) as manager:
        for step in steps:
            manager.save(model, TrainingState(global_step=step), wait=True)


def test_runs_on_a_prefix_lists_what_the_commit_markers_publish(
    saved, s3_bucket, s3_server, tmp_path, capsys
):
    """Two runs; a killed upload's objects (no marker) and a marker a resume set aside are
    not listed; an export directory's numbered versions are exports."""
    _checkpoints(f"{s3_bucket}/other/checkpoints", [3, 5], tmp_path / "staging-other")
    root = s3_bucket[len("s3://") :]
    s3_server.fs.pipe_file(f"{root}/run/checkpoints/step-00000099/model.weights.h5", b"partial")
    marker = s3_server.fs.cat_file(f"{root}/other/checkpoints/.commits/step-00000003.json")
    s3_server.fs.pipe_file(f"{root}/other/checkpoints/abandoned-1/.commits/step-9.json", marker)
    version = tmp_path / "1"
    version.mkdir()
    (version / "saved_model.pb").write_bytes(b"graph")
    RemoteCheckpoints(f"{s3_bucket}/run/export").publish(version, step=7)

    assert cli_main(["runs", s3_bucket, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in listing["runs"]] == ["other", "run"]
    other, run = listing["runs"]
    assert [(c["name"], c["step"], c["latest"]) for c in other["checkpoints"]] == [
        ("step-00000003", 3, False),
        ("step-00000005", 5, True),
    ]
    assert other["exports"] == [] and other["run_dir"] == f"{s3_bucket}/other"
    assert [c["name"] for c in run["checkpoints"]] == ["step-00000007"]
    assert [(e["name"], e["step"], e["bytes"]) for e in run["exports"]] == [("1", 7, 5)]

    assert cli_main(["runs", f"{s3_bucket}/run"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"1 run(s) under {s3_bucket}/run")
    assert "checkpoint step-00000007" in text and "(latest)" in text and "export     1" in text


def test_runs_on_a_missing_bucket_is_one_error_line(s3_bucket, capsys):
    assert cli_main(["runs", "s3://no-such-bucket-r/runs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no-such-bucket-r" in err and len(err.splitlines()) == 1


def test_export_a_checkpoint_url(saved, tmp_path, capsys):
    """Downloaded through the cache, then exported as a local checkpoint is; the export
    records the checkpoint `latest` named, and serves what the checkpoint predicts."""
    import tensorflow as tf

    from trainer.exports.exporter import read_export_metadata
    from trainer.save_backends import load_checkpoint

    out = tmp_path / "serving"
    assert cli_main(["export", f"{saved}/latest", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == 1
    meta = read_export_metadata(out / "1")
    assert meta["source"]["checkpoint"] == f"{saved}/step-00000007"
    assert meta["state"]["global_step"] == 7
    x = np.arange(6, dtype="float32").reshape(2, 3)
    served = tf.saved_model.load(str(out / "1")).signatures["serving_default"]
    (got,) = served(tf.constant(x)).values()
    want = load_checkpoint(f"{saved}/latest").model.predict(x, verbose=0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_export_of_a_checkpoint_missing_on_the_store_is_one_error_line(saved, tmp_path, capsys):
    out = tmp_path / "serving"
    assert cli_main(["export", f"{saved}/step-00000008", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "step-00000008" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_export_to_a_url_publishes_each_version_complete(saved, s3_bucket, s3_server, capsys):
    """``trainer export CHECKPOINT s3://...``: each version is published by its marker
    after its objects, under the next free number, with ``latest``; ``--keep`` removes
    the store's older versions; the published version serves what the checkpoint
    predicts once downloaded and verified (``trainer verify``)."""
    import tensorflow as tf

    from trainer.save_backends import load_checkpoint
    from trainer.save_backends.loading import fetch_remote

    target = f"{s3_bucket}/serving/model"
    reports = []
    for _ in range(2):
        assert cli_main(["export", f"{saved}/latest", target, "--keep", "1", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out)["export"])
    assert reports == [f"{target}/1", f"{target}/2"]
    remote = RemoteCheckpoints(target)
    assert [m["name"] for m in remote.committed()] == ["2"]  # --keep 1: version 1 went
    assert s3_server.fs.cat_file(f"{target[5:]}/latest") == b"2"
    assert sorted({k.split("/", 1)[0] for k in remote.store.walk("")}) == [
        ".commits",
        "2",
        "latest",
    ]
    assert cli_main(["verify", f"{target}/latest"]) == 0
    x = np.arange(6, dtype="float32").reshape(2, 3)
    served = tf.saved_model.load(str(fetch_remote(f"{target}/2"))).signatures["serving_default"]
    (got,) = served(tf.constant(x)).values()
    want = load_checkpoint(f"{saved}/latest").model.predict(x, verbose=0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_export_to_a_missing_bucket_is_one_error_line_before_exporting(saved, capsys):
    assert cli_main(["export", f"{saved}/latest", "s3://no-such-bucket-x/serving"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no-such-bucket-x" in err and len(err.splitlines()) == 1


def test_export_with_its_tensorboard_log_on_the_store(
    saved, s3_bucket, s3_server, tmp_path, monkeypatch, capsys
):
    """``trainer export CHECKPOINT OUT --tensorboard s3://...``: the card and graph are
    written into a local temporary log, then uploaded to the log's URL; the export's link
    records the log's URL and, for an export published on the store, its card names the
    version's URL. A second export adds its event file beside the first's."""
    from trainer.exports.exporter import read_export_metadata
    from trainer.save_backends.loading import fetch_remote

    monkeypatch.chdir(tmp_path)
    log_url, target = f"{s3_bucket}/logs/exports", f"{s3_bucket}/serving/model"
    args = ["export", f"{saved}/latest", target, "--tensorboard", log_url, "--json"]
    assert cli_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["export"] == f"{target}/1"
    assert report["tensorboard"]["log_url"] == log_url and report["tensorboard"]["step"] == 7
    published = read_export_metadata(fetch_remote(f"{target}/1"))
    assert published["tensorboard"]["log_url"] == log_url
    events = [k for k in objects(s3_server, log_url) if "tfevents" in k]
    assert len(events) == 1, objects(s3_server, log_url)
    data = s3_server.fs.cat_file(f"{log_url[5:]}/{events[0]}")
    assert f"{target}/1".encode() in data  # the card names the version on the store

    out = tmp_path / "serving"
    assert cli_main(["export", f"{saved}/latest", str(out), "--tensorboard", log_url]) == 0
    assert f"tensorboard log: {log_url}" in capsys.readouterr().out
    assert read_export_metadata(out / "1")["tensorboard"]["log_url"] == log_url
    assert len([k for k in objects(s3_server, log_url) if "tfevents" in k]) == 2
    assert not (tmp_path / "s3:").exists()


def test_export_with_a_tensorboard_url_it_cannot_use_is_one_error_line(
    saved, tmp_path, monkeypatch, capsys
):
    from trainer.errors import UnsupportedLocationError
    from trainer.exports.sources import export_from_checkpoint

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "serving"
    for url, named in (("s3://no-such-bucket-t/logs", "no-such-bucket-t"), ("az://b/l", "az://")):
        assert cli_main(["export", f"{saved}/latest", str(out), "--tensorboard", url]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and named in err and len(err.splitlines()) == 1, err
        assert "Received:" in err and not out.exists()  # refused before exporting
    # The Python API takes a local log directory only: a URL is refused, never a folder "s3:".
    with pytest.raises(UnsupportedLocationError, match="TensorBoard log directory"):
        export_from_checkpoint(f"{saved}/latest", out, tensorboard="s3://bucket/logs")
    assert not (tmp_path / "s3:").exists() and not out.exists()
