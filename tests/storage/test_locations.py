"""A URL is never taken for a local folder: ``s3://bucket/x`` used to train into ``./s3:``
and load back from there, while the user believed the checkpoints were on the store."""

from __future__ import annotations

import os
from pathlib import Path

import keras
import pytest

from tests.helpers.train_py import TINY_ARGS, train_py
from trainer.checkpointing import CheckpointManager
from trainer.cli.app import main
from trainer.errors import UnsupportedLocationError
from trainer.exports.exporter import export_serving
from trainer.save_backends import get_backend, load_checkpoint
from trainer.storage.locations import local_path, url_scheme

URL = "s3://bucket/runs/x"
# A scheme no store serves: refused even where s3:// URLs are served (tests/storage/
# test_remote.py and tests/checkpointing/test_remote_manager.py use a real S3 server).
GS = "az://bucket/runs/x"


def test_plain_paths_and_file_urls_are_local_and_other_urls_are_refused(tmp_path):
    assert local_path("runs/x") == Path("runs/x")
    assert local_path(tmp_path) == tmp_path
    assert local_path(f"file://{tmp_path}/a%20b") == tmp_path / "a b"
    assert url_scheme(r"C:\runs") is None and url_scheme("GS://b/x") == "gs"
    for url in (URL, "gs://bucket/x", "hdfs://name/x", "file://otherhost/x"):
        with pytest.raises(UnsupportedLocationError, match=r"Received: '") as caught:
            local_path(url, "run_dir")
        assert "run_dir" in str(caught.value)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _model() -> keras.Model:
    inputs = keras.Input((2,))
    return keras.Model(inputs, keras.layers.Dense(1)(inputs))


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_no_api_entry_takes_a_url_for_a_local_folder(in_tmp, backend):
    model = _model()
    calls = {
        "save": lambda: get_backend(backend).save(model, URL),
        "load": lambda: get_backend(backend).load(URL),
        "load_checkpoint": lambda: load_checkpoint(GS),
        "manager": lambda: CheckpointManager(GS, backend=backend),
        "export": lambda: export_serving(model, URL, format="keras"),
    }
    for name, call in calls.items():
        with pytest.raises(UnsupportedLocationError, match=r"s3://|az:// is not supported"):
            call()
        assert os.listdir(in_tmp) == [], f"{name} created {os.listdir(in_tmp)}"


def test_the_cli_refuses_urls_it_cannot_serve_with_exit_2(in_tmp, capsys):
    """Every command that reads or writes s3:// URLs (tests/cli/test_store_urls.py)
    refuses other schemes, ``export``'s output directory before exporting."""
    for argv in (
        ["inspect", GS],
        ["verify", GS],
        ["runs", GS],
        ["export", GS, "out"],
        ["export", "c", GS],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "az:// is not supported" in err, argv
    assert os.listdir(in_tmp) == []


@pytest.mark.slow
def test_train_py_refuses_a_url_run_dir_before_anything_is_written(in_tmp):
    proc = train_py(*TINY_ARGS, f"run_dir={GS}", f"hydra.run.dir={in_tmp / 'out'}")
    assert proc.returncode == 2, proc.output
    assert "az:// is not supported" in proc.output
    assert not (in_tmp / "az:").exists() and not (Path.cwd() / "az:").exists()
