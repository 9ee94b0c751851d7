"""TensorBoard writes honour ``checkpoint.policy.on_save_error`` (issue 16, item 9).

A real full disk, no mocks: from global step 5 on no file of the run may grow past 1000
bytes (``RLIMIT_FSIZE`` in a child process, tests/children/tensorboard_fault_child.py), so the
summary writer's event files fail at every step and every checkpoint fails too. Before
the fix, training died with TensorFlow's raw ``OutOfRangeError`` ("File too large"; a real
full disk: ``ResourceExhaustedError``) from the summary writer under either policy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import warm
from tests.helpers.paths import CHILDREN_DIR
from tests.helpers.processes import subprocess_env

CHILD = CHILDREN_DIR / "tensorboard_fault_child.py"
LIMIT = 1000  # below every event file's size after four steps: each later append fails


def start(out, on_save_error: str, every_n_steps: str) -> subprocess.Popen:
    env = subprocess_env()
    env["PYTHONPATH"] = f"{CHILDREN_DIR}:{env['PYTHONPATH']}"
    args = [str(out), str(LIMIT), on_save_error, every_n_steps]
    return warm.Popen(
        [sys.executable, str(CHILD), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def report(process: subprocess.Popen) -> dict:
    try:
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, f"child died with {process.returncode}: {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both children started together (two cores run them in about half the time)."""
    started = {
        # Checkpoints at every step too: their failures and the TensorBoard ones together.
        "continue": start(tmp_path_factory.mktemp("continue"), "continue", "1"),
        # Epoch checkpoints only: the first write after the fault is a TensorBoard one.
        "raise": start(tmp_path_factory.mktemp("raise"), "raise", "null"),
    }
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow
def test_continue_logs_each_kind_of_tensorboard_failure_once_and_finishes(runs):
    result = report(runs["continue"])
    assert result["finished"], result
    assert set(result["checkpoints"].values()) == {1, 2, 3, 4}  # written before the fault
    tensorboard = [line for line in result["log"] if " failed; the run continues" in line]
    kinds = [line.split("/tb: ")[1].split(" failed")[0] for line in tensorboard]
    # Eight batches and two epochs failed after the fault; each kind is logged once.
    assert "writing batch scalars" in kinds and "writing epoch scalars" in kinds, result["log"]
    assert len(kinds) == len(set(kinds)), tensorboard
    assert all(line.startswith("WARNING") for line in tensorboard)
    assert all("on_save_error=continue" in line for line in tensorboard)
    assert all("Received: OutOfRangeError" in line for line in tensorboard)
    totals = [line for line in result["log"] if "writes that failed in all" in line]
    assert any("8 x writing batch scalars" in line for line in totals), totals
    # The checkpoint failures are still logged one by one, as before.
    assert sum("Training continues" in line for line in result["log"]) == 8


@pytest.mark.slow
def test_raise_stops_training_with_a_trainer_error(runs):
    result = report(runs["raise"])
    assert not result["finished"], result
    assert result["error"] == "TensorBoardWriteError", result
    assert {"SaveError", "TrainerError"} <= set(result["mro"])
    message = result["message"]
    assert "/tb: writing batch scalars failed, so training stopped" in message
    assert "on_save_error=continue" in message  # what to do
    assert "Received: OutOfRangeError" in message and "File too large" in message
    assert set(result["checkpoints"].values()) == {4}  # the epoch-1 checkpoint is intact
