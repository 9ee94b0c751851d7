"""Sessions and sweeps of ``python train.py`` (issue 16 items 13, 15, 11-resume).

Real ``train.py`` processes with real signals (tests/plugins/faults.SignalAtStep sends the
process a SIGTERM at a chosen step); tiny runs of 2 epochs of 3 batches. Each process run
serves several asserts, to keep the module quick.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, subprocess_env

from trainer.save_backends import load_checkpoint

TINY = [
    "model=mlp",
    "data=synthetic",
    "save=weights",  # the quickest backend; the backends have tests of their own
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "trainer.steps_per_epoch=3",
    "trainer.verbose=0",
    "export.enabled=false",
]
SIGTERM_AT_STEP_1 = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 1}"
HANG_GUARD = 300  # seconds; only against a hung child, never asserted as a duration


def train_py(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None):
    """Run ``python train.py ARGS`` to the end; stdout and stderr together in ``.output``."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd, env=env or subprocess_env(), capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    proc.output = proc.stdout + proc.stderr
    return proc


def command_after(output: str, marker: str) -> list[str]:
    """The command printed after ``marker`` on a log line, split as a shell would."""
    for line in output.splitlines():
        if marker in line:
            return shlex.split(line.split(marker, 1)[1])
    raise AssertionError(f"no {marker!r} printed:\n{output[-3000:]}")


def state_of(run: Path):
    return load_checkpoint(run / "checkpoints" / "latest").state


# ------------------------------------------------------------------ item 13: multirun
@pytest.fixture(scope="module")
def stopped_sweep(tmp_path_factory):
    """``-m seed=0,1,2`` whose first job SIGTERMs itself after step 1 (it stops after step
    2, mid-epoch, with an interrupt checkpoint)."""
    sweep = tmp_path_factory.mktemp("sweep") / "multirun"
    proc = train_py("-m", *TINY, "seed=0,1,2", SIGTERM_AT_STEP_1, f"hydra.sweep.dir={sweep}")
    return sweep, proc


@pytest.mark.slow
def test_sigterm_stops_the_whole_sweep(stopped_sweep):
    """Item 13: before, jobs #1 and #2 ran after job #0 was interrupted."""
    sweep, proc = stopped_sweep
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Traceback" not in proc.output
    state = state_of(sweep / "0")
    assert (state.epoch, state.step_in_epoch) == (0, 2)  # job #0's interrupt checkpoint
    assert not (sweep / "1" / "checkpoints").exists()
    assert not (sweep / "2" / "checkpoints").exists()
    assert "Not running job #1 (seed=1)" in proc.output
    assert "Not running job #2 (seed=2)" in proc.output
    (line,) = [x for x in proc.output.splitlines() if "Sweep stopped by SIGTERM" in x]
    assert "during job #0 (seed=0" in line and "jobs not run: #1 (seed=1" in line


@pytest.mark.slow
def test_the_printed_command_continues_the_sweep(stopped_sweep, tmp_path):
    """Run as printed (without the test's own signal hook), the sweep finishes in place:
    job #0 resumes from its interrupt checkpoint, jobs #1 and #2 run."""
    sweep, proc = stopped_sweep
    command = command_after(proc.output, "the rest start) with: ")
    assert command[:3] == ["python", "train.py", "-m"]
    assert {f"hydra.sweep.dir={sweep}", "resume=auto", "seed=0,1,2"} <= set(command)
    command.remove(SIGTERM_AT_STEP_1)  # the test's fault injection, not part of the sweep
    resumed = train_py(*command[2:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "Sweep stopped" not in resumed.output
    for job in ("0", "1", "2"):
        state = state_of(sweep / job)
        assert (state.epoch, state.step_in_epoch, state.global_step) == (2, 0, 6)
        assert len(state.history) == 2
    assert f"Resuming from {sweep / '0' / 'checkpoints'}" in resumed.output
