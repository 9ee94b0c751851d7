"""A reader polling ``checkpoints/latest`` while a trainer process checkpoints every two
steps (keeping two, so retention deletes checkpoints under the reader's feet): hundreds
of loads, each digest-verified, none partial, mixed or failed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.helpers import warm
from tests.helpers.paths import CHILDREN_DIR, ROOT
from tests.helpers.processes import subprocess_env


def train_command(run_dir, backend):
    return [
        sys.executable, str(ROOT / "train.py"), "model=mlp", "data=synthetic",
        "trainer.verbose=0", "trainer.batch_size=16", "trainer.epochs=100000",
        f"save={backend}", "checkpoint.policy.every_n_steps=2", "checkpoint.policy.keep_last=2",
        "checkpoint.policy.every_n_epochs=null", "export.enabled=false",
        f"hydra.run.dir={run_dir}", "hydra/job_logging=disabled",
    ]  # fmt: skip


LOADS, NEW_EVERY = 80, 4  # 80 verified loads; a new checkpoint before every 4th
HANG_GUARD = 1200  # seconds: only stops a run that hangs, never judges speed


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["weights"])
def test_reader_never_sees_a_partial_checkpoint(tmp_path, backend):
    run = tmp_path / "run"
    quiet = {**subprocess_env(), "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
    trainer_log = tmp_path / "trainer.log"
    with open(trainer_log, "w") as log:  # a file, not a pipe: a full pipe would stall it
        trainer = warm.Popen(  # one core each: the trainer leaves the other to the reader
            train_command(run, backend), env=quiet, stdout=subprocess.DEVNULL, stderr=log
        )
    try:  # started together, so that both TensorFlow start-ups overlap
        reader = warm.Popen(
            [sys.executable, str(CHILDREN_DIR / "reader_child.py"),
             str(run / "checkpoints"), str(LOADS), str(NEW_EVERY)],
            env=quiet, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # The trainer runs (100000 epochs) until the reader has done all its loads.
        stdout, stderr = wait_for_reader(reader, trainer, trainer_log)
    finally:
        trainer.send_signal(signal.SIGTERM)  # a clean stop: interrupt save, then exit 0
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
    assert reader.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["failures"] == [] and report["mismatches"] == [], report
    assert report["loads"] == LOADS, report
    assert report["distinct_steps"] >= LOADS // NEW_EVERY, report
    print(f"concurrent reader ({backend}): {report}")


def wait_for_reader(reader, trainer, trainer_log):
    """The reader's output once it is done; fails at once if the trainer stops first (the
    reader would then wait for a new checkpoint forever)."""
    for _ in range(HANG_GUARD * 2):
        try:
            return reader.communicate(timeout=0.5)
        except subprocess.TimeoutExpired:
            if trainer.poll() is not None:
                reader.kill()
                reader.communicate()
                pytest.fail(f"the trainer stopped first: {trainer_log.read_text()[-3000:]}")
    reader.kill()
    reader.communicate()
    pytest.fail(f"hung: the reader did not finish {LOADS} loads in {HANG_GUARD} s")
