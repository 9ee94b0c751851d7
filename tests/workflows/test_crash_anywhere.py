"""Crash anywhere, re-run the same command, get the same result (issue 16).

One command, ``resume=auto`` and a fixed run directory, as a scheduler of preemptible
machines would re-run it. SIGKILL lands at random moments of the whole run: during start-up
(before the first checkpoint), mid-epoch, during a save or retention, during the final save
or the export, or after it finished. Re-running the identical command each time must end
exactly like a run never stopped: the same weights and optimizer state (bitwise), the same
metrics history, an export that serves the same outputs, and no temporaries left behind.
Each kill first waits for its phase by what the run has written (a random step for a kill
mid-run), then a short random delay, so kills spread over the whole run on any machine;
nothing here judges speed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import warm
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer.checkpointing import all_variables
from trainer.errors import TrainerError
from trainer.save_backends import load_checkpoint, read_checkpoint_metadata

# The phases each backend is killed in, in order: one kill in each phase, whose code paths
# differ (start-up: a re-run that finds no checkpoint and starts fresh; training: resuming
# mid-epoch or at an epoch end, from a save or retention cut short; end: the final save or
# the export cut short, or a finished run re-run), a second mid-run one for the default
# backend. 10 SIGKILLs in all, each at a random moment of its phase. It was 20 at randomly
# drawn phases: a phase could go unhit for a backend, and once a kill had landed after the
# last checkpoint, every later one hit a re-run of the finished run. Each kill costs a start
# of TensorFlow. Kills aimed at saves in flight are test_resume_and_retention.py's.
KILLS = {
    "weights": ("start-up", "training", "training", "end"),
    "h5": ("start-up", "training", "end"),
    "savedmodel": ("start-up", "training", "end"),
}
HANG_GUARD = 600  # seconds for one process; only stops a hang
TOTAL_STEPS = 40  # 4 epochs x 10 steps; a checkpoint every 3 steps and at each epoch end


def command(run_dir, backend):
    return [
        sys.executable, str(ROOT / "train.py"), "model=mlp", "data=synthetic",
        f"save={backend}", "trainer.epochs=4", "trainer.steps_per_epoch=10",
        "trainer.batch_size=16", "trainer.verbose=0", "export.warmup_examples=0",
        "checkpoint.policy.every_n_steps=3", "checkpoint.policy.keep_last=2",
        "resume=auto", f"hydra.run.dir={run_dir}", "hydra/job_logging=disabled",
    ]  # fmt: skip


def run_to_end(run_dir, backend) -> None:
    done = warm.run(
        command(run_dir, backend), env=subprocess_env(), capture_output=True, text=True,
        timeout=HANG_GUARD,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run never stopped (weights backend; training does not depend on the backend)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    run_to_end(run, "weights")
    return outcome(run)


def newest_step(run):
    try:
        return read_checkpoint_metadata(run / "checkpoints" / "latest")["state"]["global_step"]
    except (TrainerError, OSError):
        return None


def outcome(run):
    """What a finished run leaves: every variable, the history, the export's outputs."""
    checkpoint = load_checkpoint(run / "checkpoints" / "latest")
    variables = [np.asarray(v.numpy()) for v in all_variables(checkpoint.model)]
    served = tf.saved_model.load(str(run / "export" / "1")).signatures["serving_default"]
    ((name, spec),) = served.structured_input_signature[1].items()
    x = np.random.default_rng(0).normal(size=(5, *spec.shape[1:])).astype("float32")
    (output,) = served(**{name: tf.constant(x)}).values()
    leftovers = [
        p.name
        for folder in (run / "checkpoints", run / "export")
        for p in folder.iterdir()
        if p.name.startswith(".")
    ]
    exports = sorted(p.name for p in (run / "export").iterdir() if not p.name.startswith("."))
    return {
        "variables": variables,
        "state": (checkpoint.state.epoch, checkpoint.state.global_step),
        "history": checkpoint.state.history,
        "served": output.numpy(),
        "leftovers": leftovers,
        "exports": exports,
    }


def kill_moment(proc, run, phase, rng) -> None:
    """Wait until the process reaches ``phase`` (by what it has written, not by the clock),
    then a short random delay; returns early if the process exits."""
    start = (newest_step(run) or 0) + 1
    if phase == "training" and start < TOTAL_STEPS:
        target = int(rng.integers(start, TOTAL_STEPS))
        while proc.poll() is None and (newest_step(run) or 0) < target:
            time.sleep(0.02)
    elif phase != "start-up":  # the end (or training already over)
        while proc.poll() is None and newest_step(run) != TOTAL_STEPS:
            time.sleep(0.02)
    delay = {"start-up": 4.0, "training": 0.3, "end": 2.0}[phase]
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=rng.uniform(0.0, delay))


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(KILLS))
def test_killed_anywhere_and_rerun_ends_like_a_run_never_stopped(tmp_path, reference, backend):
    expected = reference
    rng = np.random.default_rng(sorted(KILLS).index(backend))
    run = tmp_path / "run"
    kills, finished_early = [], 0  # (phase, newest checkpoint step when killed)
    while len(kills) < len(KILLS[backend]):
        phase = KILLS[backend][len(kills)]
        proc = warm.Popen(
            command(run, backend), env=subprocess_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        kill_moment(proc, run, phase, rng)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=HANG_GUARD)
            kills.append((phase, newest_step(run)))
            continue
        stderr = proc.stderr.read()
        assert proc.returncode == 0, stderr[-3000:]  # finished before its kill: a re-run
        finished_early += 1
        assert finished_early <= 40, "the runs keep finishing before they can be killed"
    run_to_end(run, backend)  # the same command once more, to the end
    print(f"{backend}: kills (phase, newest checkpoint step) {kills}; {finished_early} re-runs")
    got = outcome(run)
    assert got["leftovers"] == [] and got["exports"] == expected["exports"] == ["1"]
    assert got["state"] == expected["state"] and got["history"] == expected["history"]
    assert len(got["variables"]) == len(expected["variables"])
    for mine, theirs in zip(got["variables"], expected["variables"], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(got["served"], expected["served"])
