"""Sessions and sweeps of ``python train.py`` (issue 16 items 13, 15, 11-resume).

Real ``train.py`` processes with real signals (tests/plugins/faults.SignalAtStep sends the
process a SIGTERM at a chosen step); tiny runs of 2 epochs of 3 batches. Each process run
serves several asserts, to keep the module quick.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from tests.helpers.train_py import TINY_ARGS, train_py
from trainer.save_backends import load_checkpoint

SIGTERM_AT_STEP_1 = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 1}"


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
    proc = train_py("-m", *TINY_ARGS, "seed=0,1,2", SIGTERM_AT_STEP_1, f"hydra.sweep.dir={sweep}")
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


# ------------------------------------------------------- item 15: sessions of a run
@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A run interrupted in its first epoch, resumed by its printed command into a Hydra
    output directory of its own (as every plain ``python train.py`` invocation gets)."""
    outputs = tmp_path_factory.mktemp("sessions") / "outputs"
    run, later = outputs / "first", outputs / "second"
    first = train_py(*TINY_ARGS, SIGTERM_AT_STEP_1, f"hydra.run.dir={run}")
    assert first.returncode == 0, first.output[-3000:]
    command = command_after(first.output, "resume with: ")
    second = train_py(*command[2:], f"hydra.run.dir={later}")
    assert second.returncode == 0, second.output[-3000:]
    return outputs, run, later


@pytest.mark.slow
def test_a_resumed_session_logs_into_the_runs_own_log(resumed_run):
    """Item 15: before, the run's train.log ended with the first session's interrupt."""
    _, run, later = resumed_run
    log = (run / "train.log").read_text()
    assert "Interrupted in epoch 1, after 2 of its batches, step 2" in log  # the first session
    assert f"Resuming from {run / 'checkpoints'}" in log  # the second one, appended
    assert "Final metrics:" in log
    assert f"Session 2 of run {run}" in log
    assert "Final metrics:" in (later / "train.log").read_text()  # Hydra's own copy stays


@pytest.mark.slow
def test_each_session_keeps_its_hydra_config_in_the_run(resumed_run):
    import yaml

    _, run, later = resumed_run
    sessions = run / ".hydra" / "sessions"
    assert sorted(p.name for p in sessions.iterdir()) == ["1", "2"]
    first = yaml.safe_load((sessions / "1" / "overrides.yaml").read_text())
    second = yaml.safe_load((sessions / "2" / "overrides.yaml").read_text())
    assert "resume=latest" not in first and "resume=latest" in second
    info = yaml.safe_load((sessions / "2" / "session.yaml").read_text())
    assert info["hydra_output_dir"] == str(later)
    assert info["resumed_from"].startswith(str(run / "checkpoints"))
    assert (sessions / "2" / "config.yaml").is_file()


@pytest.mark.slow
def test_runs_lists_one_run_with_its_sessions(resumed_run):
    """Before, ``runs`` listed the resume session's directory as a second, empty run."""
    from trainer.runs.index import format_runs, list_runs

    outputs, run, later = resumed_run
    listing = list_runs(outputs)
    assert [r["run_dir"] for r in listing["runs"]] == [str(run)]
    assert [s["session"] for s in listing["runs"][0]["sessions"]] == [1, 2]
    assert [(s["dir"], s["run_dir"]) for s in listing["session_dirs"]] == [(str(later), str(run))]
    text = format_runs(listing)
    assert text.startswith("1 run(s)") and "2 sessions" in text


# ------------------------------------- item 11: resuming a backend chosen by _target_
EXAMPLE_DIR = ROOT / "tests" / "example_backend"
NPZ = "save._target_=mybackend.NpzBackend"  # importable, never registered


@pytest.fixture(scope="module")
def npz_run(tmp_path_factory):
    """A run with the example backend selected by ``save._target_`` (not registered),
    interrupted in its first epoch, then resumed with its printed ``resume=latest``."""
    run = tmp_path_factory.mktemp("npz") / "run"
    env = subprocess_env()
    env["PYTHONPATH"] = f"{EXAMPLE_DIR}:{env['PYTHONPATH']}"
    first = train_py(*TINY_ARGS, NPZ, SIGTERM_AT_STEP_1, f"hydra.run.dir={run}", env=env)
    assert first.returncode == 0, first.output[-3000:]
    interrupt = sorted((run / "checkpoints").glob("*.npz"))
    command = command_after(first.output, "resume with: ")
    assert "resume=latest" in command
    second = train_py(*command[2:], f"hydra.run.dir={run.parent / 'second'}", env=env)
    return run, interrupt, second


@pytest.mark.slow
def test_resume_latest_reads_the_configured_unregistered_backend(npz_run):
    """Before: "resume=latest found no complete checkpoint" (exit 2)."""
    import mybackend  # via the module fixture's sys.path (below)

    run, interrupt, second = npz_run
    assert [p.name for p in interrupt] == ["step-00000002.npz"]
    assert second.returncode == 0, second.output[-3000:]
    assert f"Resuming from {interrupt[0]} at epoch 0, step 2" in second.output
    state = mybackend.NpzBackend().load(run / "checkpoints" / "latest").state
    assert (state.epoch, state.step_in_epoch, state.global_step) == (2, 0, 6)


@pytest.mark.slow
def test_resume_from_a_file_of_the_configured_backend(npz_run, compose_cfg, tmp_path):
    """``resume=<file>``: before, "not a checkpoint in any registered format"."""
    import shutil

    from trainer import train

    run, interrupt, _ = npz_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    cfg = compose_cfg(
        "model=mlp", "save=weights", NPZ, f"resume={copy / 'checkpoints' / interrupt[0].name}"
    )
    metrics = train(cfg)
    assert metrics
    import mybackend

    state = mybackend.NpzBackend().load(copy / "checkpoints" / "latest").state
    assert (state.epoch, state.global_step) == (2, 6)


@pytest.fixture(autouse=True, scope="module")
def _example_backend_importable():
    """``mybackend`` importable here as a user's module would be (never registered)."""
    sys.path.insert(0, str(EXAMPLE_DIR))
    yield
    sys.path.remove(str(EXAMPLE_DIR))
    sys.modules.pop("mybackend", None)


def test_the_run_log_is_never_appended_through_a_symbolic_link(tmp_path, caplog):
    """A resumed session appends its log to the run's train.log; a run directory from
    elsewhere whose train.log is a link made it append to the file the link names."""
    import logging

    from trainer.runs.sessions import mirror_file_logs

    output, run, target = tmp_path / "out", tmp_path / "run", tmp_path / "elsewhere"
    output.mkdir()
    run.mkdir()
    target.write_text("theirs\n")
    (run / "train.log").symlink_to(target)
    handler = logging.FileHandler(output / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        added = mirror_file_logs(output, run)
        logging.getLogger("trainer").warning("a line")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert added == [] and target.read_text() == "theirs\n"
    assert "it is a symbolic link" in caplog.text
