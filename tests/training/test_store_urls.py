"""``train(cfg)`` / ``python train.py`` with URLs for ``resume``, ``resume_dir``,
``export.directory`` and ``trainer.tensorboard_dir`` (issue 40), against a real
S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.config import compose_run
from tests.helpers.s3_server import bucket_env, objects
from tests.helpers.train_py import TINY_ARGS, train_py
from trainer import train
from trainer.checkpointing import all_variables
from trainer.errors import NotACheckpointError, UnsupportedLocationError
from trainer.save_backends import load_checkpoint

# schedule=none: a cosine schedule spans trainer.epochs, which the resumed runs raise.
RUN = ["model=mlp", "model.dropout=0.3", "save=weights", "schedule=none"]


def _variables(checkpoint) -> list[np.ndarray]:
    return [np.asarray(v) for v in all_variables(checkpoint.model)]


@pytest.fixture(scope="module")
def store_run(s3_server, tmp_path_factory):
    """A run of one epoch on the store (the checkpoint others resume from), and the final
    variables of a run of two epochs on disk never stopped: a run resumed from the first
    for a second epoch ends there, bitwise."""
    tmp = tmp_path_factory.mktemp("store-run")
    with bucket_env(s3_server, tmp / "store-cache") as bucket:
        url = f"{bucket}/source"
        train(compose_run(tmp / "mirror", *RUN, f"run_dir={url}", "trainer.epochs=1"))
        train(compose_run(tmp / "straight", *RUN))
        straight = load_checkpoint(tmp / "straight" / "checkpoints" / "latest")
        return url, _variables(straight), straight.state.global_step


def test_a_run_on_disk_resumes_from_a_checkpoint_url(compose_cfg, s3_bucket, s3_server, store_run):
    """``resume=<run URL>/checkpoints/latest`` with a local ``run_dir``: the checkpoint is
    downloaded, the run continues in its own directory and ends where a run never stopped
    ends; the store it came from is only read."""
    source, expected, steps = store_run
    before = objects(s3_server, source)
    cfg = compose_cfg(*RUN, f"resume={source}/checkpoints/latest")
    train(cfg)
    final = load_checkpoint(f"{cfg.run_dir}/checkpoints/latest")
    assert final.state.global_step == steps
    for got, want in zip(_variables(final), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert objects(s3_server, source) == before


def test_a_run_on_the_store_resumes_from_another_runs_url(
    s3_bucket, s3_server, store_run, tmp_path
):
    """``resume_dir=<run URL> resume=auto`` with ``run_dir`` on the store: the newest
    checkpoint of that run, continued in the new run's URL; re-running the same command
    then continues the new run's own checkpoints (here: nothing left to train)."""
    source, expected, steps = store_run
    before = objects(s3_server, source)
    url = f"{s3_bucket}/continued"
    args = [*RUN, f"run_dir={url}", f"resume_dir={source}", "resume=auto"]
    train(compose_run(tmp_path / "mirror", *args))
    final = load_checkpoint(f"{url}/checkpoints/latest")
    assert final.state.global_step == steps
    for got, want in zip(_variables(final), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert objects(s3_server, source) == before
    names = [k for k in objects(s3_server, url) if k.startswith("checkpoints/.commits/")]
    train(compose_run(tmp_path / "mirror", *args))  # its own newest: already finished
    assert [k for k in objects(s3_server, url) if k.startswith("checkpoints/.commits/")] == names


def test_a_url_that_names_no_checkpoint_is_refused(compose_cfg, s3_bucket, store_run):
    source, _, _ = store_run
    with pytest.raises(NotACheckpointError, match="names no complete checkpoint"):
        train(compose_cfg(*RUN, f"resume={s3_bucket}/nothing/here"))
    with pytest.raises(NotACheckpointError, match="names no complete checkpoint"):
        train(compose_cfg(*RUN, f"resume={source}/checkpoints/ckpt-no-such"))
    with pytest.raises(NotACheckpointError, match="no complete checkpoint in"):
        train(compose_cfg(*RUN, f"resume_dir={s3_bucket}/empty", "resume=latest"))
    with pytest.raises(UnsupportedLocationError, match="az:// is not supported"):
        train(compose_cfg(*RUN, "resume=az://bucket/run/checkpoints/latest"))


def test_train_py_resuming_from_a_missing_bucket_is_one_error_line(s3_bucket, tmp_path):
    proc = train_py(*TINY_ARGS, "resume=s3://no-such-bucket-z/run/checkpoints/latest", cwd=tmp_path)
    assert proc.returncode == 2, proc.output
    errors = [line for line in proc.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bucket 'no-such-bucket-z'" in errors[0], proc.output
    assert not (tmp_path / "s3:").exists()


def test_the_session_record_names_the_checkpoint_url_resumed_from(s3_bucket, store_run, tmp_path):
    """``python train.py resume=<URL>`` with a run on disk: the session record
    (``.hydra/sessions/1/session.yaml``, listed by ``trainer runs --json``) names the
    checkpoint's URL (the name ``latest`` held), not its copy in the local cache."""
    import yaml

    from trainer.storage.store import Store

    source, _, _ = store_run
    run = tmp_path / "run"
    args = ["model.dropout=0.3", "schedule=none", f"hydra.run.dir={run}"]
    proc = train_py(*TINY_ARGS, *args, f"resume={source}/checkpoints/latest", cwd=tmp_path)
    assert proc.returncode == 0, proc.output
    record = yaml.safe_load((run / ".hydra" / "sessions" / "1" / "session.yaml").read_text())
    name = Store(f"{source}/checkpoints").get_bytes("latest").decode()
    assert record["resumed_from"] == f"{source}/checkpoints/{name}", record


@pytest.fixture(scope="module")
def targets_run(s3_server, tmp_path_factory):
    """A run on disk whose serving export and TensorBoard log go to URLs on the store
    (``export.directory=s3://...``, ``trainer.tensorboard_dir=s3://...``)."""
    tmp = tmp_path_factory.mktemp("targets")
    with bucket_env(s3_server, tmp / "store-cache") as bucket:
        export_url, tb_url = f"{bucket}/serving/model", f"{bucket}/logs/run-1"
        train(
            compose_run(
                tmp / "run",
                *RUN,
                "trainer.epochs=1",
                "export.enabled=true",
                "export.warmup_examples=0",
                f"export.directory={export_url}",
                f"trainer.tensorboard_dir={tb_url}",
            )
        )
        yield tmp / "run", export_url, tb_url


def _files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_export_goes_to_its_url_published_by_its_marker(s3_server, targets_run):
    """``export.directory=s3://...`` with a run on disk: the version is written locally
    (``<run>/export/1``), then uploaded to ``<URL>/1/`` and published (marker written last,
    ``latest``); ``trainer verify`` checks the published version whole."""
    from trainer.cli.app import main as cli_main
    from trainer.storage.remote import RemoteCheckpoints

    run, export_url, _ = targets_run
    local = _files(run / "export" / "1")
    assert "saved_model.pb" in local
    on_store = {k[2:]: k for k in objects(s3_server, export_url) if k.startswith("1/")}
    assert sorted(on_store) == sorted(local)
    for relative, key in on_store.items():
        assert s3_server.fs.cat_file(f"{export_url[5:]}/{key}") == local[relative], relative
    marker = RemoteCheckpoints(export_url).marker("1")
    assert marker is not None and sorted(o["path"] for o in marker["objects"]) == sorted(local)
    assert s3_server.fs.cat_file(f"{export_url[5:]}/latest") == b"1"
    assert cli_main(["verify", f"{export_url}/latest"]) == 0
    assert not (run / "s3:").exists()


def test_the_event_files_go_to_the_log_url_and_the_links_name_it(s3_server, targets_run):
    """``trainer.tensorboard_dir=s3://...``: the local log (``<run>/tb``) is on the store
    byte for byte; the checkpoint's and the export's TensorBoard links record the log's
    URL, and the export's card records the version's URL."""
    import json

    from trainer.exports.exporter import export_metadata_path

    run, export_url, tb_url = targets_run
    local = _files(run / "tb")
    assert any("tfevents" in name for name in local)
    assert sorted(objects(s3_server, tb_url)) == sorted(local)
    for relative, data in local.items():
        assert s3_server.fs.cat_file(f"{tb_url[5:]}/{relative}") == data, relative
    checkpoint = load_checkpoint(run / "checkpoints" / "latest")
    assert checkpoint.metadata["tensorboard"]["log_url"] == tb_url
    exported = json.loads(export_metadata_path(run / "export" / "1").read_text())
    assert exported["tensorboard"]["log_url"] == tb_url
    assert any(f"{export_url}/1".encode() in data for data in local.values())


def test_a_missing_bucket_or_unknown_scheme_of_a_target_is_refused_before_training(
    compose_cfg, s3_bucket
):
    from trainer.errors import StoreError

    cfg = compose_cfg(*RUN, "export.directory=s3://no-such-bucket-e/serving")
    with pytest.raises(StoreError, match="no-such-bucket-e"):
        train(cfg)
    assert not (Path(cfg.run_dir) / "checkpoints").exists()  # refused before training
    with pytest.raises(
        UnsupportedLocationError, match=r"s3:// URLs.*gs:// URLs.*az:// is not supported"
    ):
        train(compose_cfg(*RUN, "trainer.tensorboard_dir=az://bucket/tb"))


def test_resuming_from_a_serving_export_on_the_store_is_refused(compose_cfg, targets_run):
    _, export_url, _ = targets_run
    with pytest.raises(NotACheckpointError, match="is a serving export"):
        train(compose_cfg(*RUN, f"resume={export_url}/1"))


def test_the_run_index_finds_the_local_copies_of_url_targets(targets_run):
    """``trainer runs`` reads a run's directories from its config: for URL targets, the
    local copies (``export``, ``tb``), never a path with ``s3:`` in it."""
    from trainer.runs.index import subdir

    run, export_url, tb_url = targets_run
    config = {"export": {"directory": export_url}, "trainer": {"tensorboard_dir": tb_url}}
    assert subdir(run, config, "export") == run / "export"
    assert subdir(run, config, "tensorboard") == run / "tb"
    assert (run / "export" / "1").is_dir() and (run / "tb").is_dir()


@pytest.mark.slow
def test_a_killed_run_on_disk_has_its_log_on_the_store_up_to_its_checkpoint(
    s3_bucket, s3_server, tmp_path
):
    """``trainer.tensorboard_dir=s3://...`` with a run on disk, SIGKILLed in its second
    epoch (no end-of-session upload): the log was uploaded after the first epoch's
    checkpoint, so the curves up to it are on the store."""
    url = f"{s3_bucket}/logs/killed"
    proc = train_py(
        *TINY_ARGS,
        f"trainer.tensorboard_dir={url}",
        "checkpoint.policy.async_save=false",  # the upload is done when step 4 starts
        "+callbacks.kill={_target_: faults.SignalAtStep, step: 5, signum: 9}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == -9, proc.output
    assert (tmp_path / "run" / "checkpoints").is_dir()
    uploaded = [k for k in objects(s3_server, url) if "tfevents" in k]
    assert uploaded, objects(s3_server, url)
    for key in uploaded:  # each file whole, as far as it was flushed at the upload
        local = (tmp_path / "run" / "tb" / key).read_bytes()
        assert local.startswith(s3_server.fs.cat_file(f"{url[5:]}/{key}")), key
