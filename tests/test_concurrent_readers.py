"""A reader polling ``checkpoints/latest`` while a trainer process checkpoints every two
steps (keeping two, so retention deletes checkpoints under the reader's feet): hundreds
of loads, each digest-verified, none partial, mixed or failed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env


def train_command(run_dir, backend):
    return [
        sys.executable, str(ROOT / "train.py"), "model=mlp", "data=synthetic",
        "trainer.verbose=0", "trainer.batch_size=16", "trainer.epochs=100000",
        f"save={backend}", "checkpoint.policy.every_n_steps=2", "checkpoint.policy.keep_last=2",
        "checkpoint.policy.every_n_epochs=null", "export.enabled=false",
        f"hydra.run.dir={run_dir}", "hydra/job_logging=disabled",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["weights"])
def test_reader_never_sees_a_partial_checkpoint(tmp_path, backend):
    run = tmp_path / "run"
    quiet = {**subprocess_env(), "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    trainer = subprocess.Popen(  # one core each: the trainer leaves the other to the reader
        train_command(run, backend),
        env=quiet,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # started together, so that both TensorFlow start-ups overlap
        reader = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "reader_child.py"),
             str(run / "checkpoints"), "200", "80"],
            env=quiet, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert trainer.poll() is None, f"the trainer stopped: {trainer.stderr.read()[-3000:]}"
    finally:
        trainer.send_signal(signal.SIGTERM)  # a clean stop: interrupt save, then exit 0
        try:
            trainer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
    assert reader.returncode == 0, reader.stderr[-3000:]
    report = json.loads(reader.stdout.strip().splitlines()[-1])
    assert report["failures"] == [] and report["mismatches"] == [], report
    assert report["loads"] >= 200, report
    assert report["distinct_steps"] >= 20, f"the trainer hardly wrote meanwhile: {report}"
    print(f"concurrent reader ({backend}): {report}")
