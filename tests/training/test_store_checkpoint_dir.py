"""``train(cfg)`` / ``python train.py`` with a run on disk and ``checkpoint.directory=s3://...``
(issue 40): the checkpoints alone go to the store, with the machinery of ``run_dir=s3://``
(staging and upload, commit markers, ``latest``, the lease, retention, ``resume=auto``),
against a real S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers.config import compose_run
from tests.helpers.s3_server import objects
from tests.helpers.train_py import TINY_ARGS, train_py
from trainer import train
from trainer.checkpointing import all_variables
from trainer.errors import ConfigError, DirectoryInUseError, UnsupportedLocationError
from trainer.save_backends import load_checkpoint
from trainer.storage.lease import LEASE
from trainer.storage.store import Store

RUN = ["model=mlp", "model.dropout=0.3", "save=weights", "checkpoint.policy.keep_last=2"]
SIGTERM_AT_4 = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}"


def _variables(checkpoint) -> list[np.ndarray]:
    return [np.asarray(v) for v in all_variables(checkpoint.model)]


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    """The final variables and step of the same run on disk, never stopped."""
    run = tmp_path_factory.mktemp("never-stopped") / "run"
    train(compose_run(run, *RUN))
    final = load_checkpoint(run / "checkpoints" / "latest")
    return _variables(final), final.state.global_step


def test_a_run_on_disk_with_its_checkpoints_on_the_store_resumes_bitwise(
    compose_cfg, s3_bucket, s3_server, never_stopped
):
    """Stopped by SIGTERM after step 4 of 6 and re-run with ``resume=auto``, the run
    continues from the store's newest checkpoint and ends bitwise where a run never
    stopped ends; retention applies on the store, ``latest`` names the newest, the lease is
    released, and the run directory holds no ``s3:`` folder and no staged copy."""
    url = f"{s3_bucket}/ckpts"
    args = [*RUN, f"checkpoint.directory={url}", "resume=auto"]
    train(compose_cfg(*args, SIGTERM_AT_4))
    assert load_checkpoint(f"{url}/latest").state.global_step == 5  # after the batch in flight
    train(compose_cfg(*args))
    final = load_checkpoint(f"{url}/latest")
    expected, steps = never_stopped
    assert final.state.global_step == steps == 6
    for got, want in zip(_variables(final), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    keys = objects(s3_server, url)
    markers = sorted(k for k in keys if k.startswith(".commits/"))
    assert len(markers) == 2, keys  # keep_last=2, on the store
    name = s3_server.fs.cat_file(f"{url[5:]}/latest").decode()
    assert f".commits/{name}.json" in markers
    assert LEASE not in keys
    run = Path(compose_cfg().run_dir)
    assert not (run / "s3:").exists() and not (run / "checkpoints").exists()


def test_a_fresh_run_over_checkpoints_on_the_store_is_refused(compose_cfg, s3_bucket):
    url = f"{s3_bucket}/ckpts"
    train(compose_cfg(*RUN, f"checkpoint.directory={url}", "trainer.epochs=1"))
    with pytest.raises(ConfigError, match=rf"{url} already holds 1 checkpoint"):
        train(compose_cfg(*RUN, f"checkpoint.directory={url}", "trainer.epochs=1"))


def test_a_second_writer_of_the_checkpoint_url_is_refused_before_training(
    compose_cfg, s3_bucket, s3_server
):
    url = f"{s3_bucket}/ckpts"
    other = {"host": "other-machine", "pid": 4242, "token": "t", "expires": time.time() + 600}
    Store(url).put_bytes(LEASE, json.dumps(other).encode())
    with pytest.raises(DirectoryInUseError, match="PID 4242 on host other-machine"):
        train(compose_cfg(*RUN, f"checkpoint.directory={url}", "trainer.epochs=1"))
    assert objects(s3_server, url) == [LEASE]


def test_what_a_checkpoint_url_does_not_support_is_one_error(compose_cfg, s3_bucket, tmp_path):
    with pytest.raises(ConfigError, match=r"is on object storage.*Received: resume="):
        train(compose_cfg(*RUN, f"checkpoint.directory={s3_bucket}/c", f"resume={tmp_path}"))
    with pytest.raises(UnsupportedLocationError, match="az:// is not supported"):
        train(compose_cfg(*RUN, "checkpoint.directory=az://bucket/ckpts"))
    assert not (tmp_path / "run" / "az:").exists()


def test_train_py_with_a_missing_bucket_for_checkpoints_is_one_error_line(s3_bucket, tmp_path):
    proc = train_py(
        *TINY_ARGS, "checkpoint.directory=s3://no-such-bucket-c/ckpts", "resume=auto", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.output
    errors = [line for line in proc.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bucket 'no-such-bucket-c'" in errors[0], proc.output
    assert "Received:" in errors[0], errors[0]
    assert not (tmp_path / "s3:").exists()


def test_the_session_record_names_the_checkpoint_url_resumed_from(s3_bucket, tmp_path, capsys):
    """``python train.py ... resume=auto`` continuing from checkpoints on the store: the
    session record (``.hydra/sessions/<n>/session.yaml``) names the checkpoint's URL, not
    its copy in the local cache, and ``trainer runs`` shows it and where the checkpoints
    are."""
    from trainer.cli.app import main as cli_main

    url = f"{s3_bucket}/ckpts"
    run = tmp_path / "run"
    args = [*TINY_ARGS, f"checkpoint.directory={url}", f"hydra.run.dir={run}"]
    first = train_py(*args, "trainer.epochs=1", cwd=tmp_path)
    assert first.returncode == 0, first.output
    second = train_py(*args, "resume=auto", cwd=tmp_path)
    assert second.returncode == 0, second.output
    records = [
        yaml.safe_load((run / ".hydra" / "sessions" / n / "session.yaml").read_text())
        for n in ("1", "2")
    ]
    assert records[0]["resumed_from"] is None
    assert records[1]["resumed_from"].startswith(f"{url}/"), records[1]
    name = records[1]["resumed_from"].rsplit("/", 1)[1]
    assert Store(url).get_bytes(f".commits/{name}.json")  # a published checkpoint's URL
    capsys.readouterr()
    assert cli_main(["runs", str(run)]) == 0
    text = capsys.readouterr().out
    assert f"session 2 resumed from {records[1]['resumed_from']}" in text, text
    assert f"checkpoints on the store: {url}" in text, text
    assert cli_main(["runs", "--json", str(run)]) == 0
    listed = json.loads(capsys.readouterr().out)["runs"][0]
    assert [s["resumed_from"] for s in listed["sessions"]] == [None, records[1]["resumed_from"]]
