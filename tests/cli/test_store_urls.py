"""``trainer inspect`` and ``trainer verify`` on an ``s3://`` checkpoint URL, against a real
S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server.py``): the checkpoint is
fetched through the verified cache, then described or verified as a local one; a damaged
object on the store is one error line and exit 2."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

from trainer.checkpointing import CheckpointManager
from trainer.cli.app import main as cli_main
from trainer.state import TrainingState


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
    assert cli_main(["inspect", "gs://bucket/run/checkpoints/latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "gs:// is not supported" in err
