"""The commands a user types: `python train.py ...` and `python -m trainer inspect ...`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import warm
from tests.helpers.checkpoints import list_checkpoints
from tests.helpers.config import TINY, config_options
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer.cli.app import main as cli_main
from trainer.save_backends import load_checkpoint


def run(args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    return warm.run(
        [sys.executable, *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_train_py_runs_for_each_backend_and_multirun_sweeps_them(tmp_path):
    """One ``python train.py -m save=<every backend>`` process: each job is a whole run of
    its backend (Hydra config, event file, two checkpoints, "Run directory:" printed), and
    the sweep gives each job its own directory. One process, not one per backend plus a
    sweep (each start-up imports TensorFlow): a job of a sweep runs the same task function
    as a plain run, and plain ``python train.py`` runs are in tests/workflows/."""
    backends = config_options("save")
    result = run(
        [str(ROOT / "train.py"), "-m", f"save={','.join(backends)}", "model=mlp", *TINY,
         f"hydra.sweep.dir={tmp_path}"],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for job, backend in enumerate(backends):
        job_dir = tmp_path / str(job)
        assert (job_dir / ".hydra" / "config.yaml").is_file()
        assert list((job_dir / "tb").glob("events.out.tfevents.*"))
        checkpoints = list_checkpoints(job_dir / "checkpoints")
        assert len(checkpoints) == 2
        checkpoint = load_checkpoint(checkpoints[-1])
        assert checkpoint.state.epoch == 2 and checkpoint.metadata["backend"] == backend
        # It says where things went.
        assert f"Run directory: {job_dir}" in result.stderr + result.stdout


def test_inspect_reports_a_checkpoint(compose_cfg, tmp_path, capsys):
    from trainer import train

    train(compose_cfg("save=h5", "model=resnet", "trainer.epochs=1"))
    (checkpoint,) = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert cli_main(["inspect", str(checkpoint), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "h5" and report["epoch"] == 1 and report["global_step"] == 3
    block = next(layer for layer in report["layers"] if layer["name"] == "block0")
    assert {child["class"] for child in block["layers"]} >= {"Conv2D", "BatchNormalization"}
    assert report["num_params"] == sum(layer["params"] for layer in report["layers"])
    assert cli_main(["inspect", str(checkpoint)]) == 0
    text = capsys.readouterr().out
    assert "backend:        h5" in text and "- block0 (ResidualBlock)" in text
    # An export written without a log of its own reports its checkpoint's link (it said
    # "no link (saved without a RunBoard)" though the link is in its metadata).
    assert cli_main(["export", str(checkpoint), str(tmp_path / "served")]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", str(tmp_path / "served" / "1"), "--json"]) == 0
    link = json.loads(capsys.readouterr().out)["tensorboard"]
    assert link["resolves"] is True and link["step"] == 3 and "source checkpoint" in link["via"]


def bad_path(tmp_path, kind):
    target = tmp_path / kind
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "junk_file":
        target.write_text("not a checkpoint")
    return target


def one_error_line(stderr: str, target) -> None:
    assert "Traceback" not in stderr
    error_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and str(target) in error_lines[0]


def test_inspect_bad_path_is_one_line_exit_2(tmp_path, capsys):
    """``python -m trainer inspect`` on a path that is no checkpoint: one ``error:`` line,
    exit 2. The process once (the entry point's exit code); each kind of bad path through
    ``main`` in-process, the function that process runs (an exception escaping it would
    fail the test here as the traceback would there)."""
    target = bad_path(tmp_path, "junk_file")
    result = run(["-m", "trainer", "inspect", str(target)], cwd=tmp_path, timeout=600)
    assert result.returncode == 2
    one_error_line(result.stderr, target)
    (tmp_path / "in-process").mkdir()
    capsys.readouterr()
    for kind in ("missing", "empty_dir", "junk_file"):
        target = bad_path(tmp_path / "in-process", kind)
        assert cli_main(["inspect", str(target)]) == 2, kind
        one_error_line(capsys.readouterr().err, target)


def test_train_py_refuses_a_bad_early_stopping_setting_with_exit_2(tmp_path):
    """patience=abc was accepted and crashed (exit 1, a traceback) at the first epoch
    without improvement."""
    result = run(
        [
            str(ROOT / "train.py"),
            "model=mlp",
            *TINY,
            "callbacks=[early_stopping]",
            "callbacks.early_stopping.patience=abc",
            "callbacks.early_stopping.min_delta=100",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: callbacks.early_stopping.patience")
    assert result.stderr.rstrip().endswith("Received: 'abc'")


def test_a_command_whose_reader_went_away_stops_quietly(tmp_path):
    """`trainer inspect ... | head -1`: the reader closes the pipe; the command printed a
    BrokenPipeError traceback (twice: the report, then the error line) and exited 1."""
    import keras

    from trainer.save_backends import get_backend

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    checkpoint = get_backend("h5").save(model, tmp_path / "ckpt")
    child = warm.Popen(
        [sys.executable, "-m", "trainer", "inspect", str(checkpoint), "--json"],
        cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    child.stdout.close()  # the reader is gone before the first line is written
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=300) == 141, stderr  # 128 + SIGPIPE, as a shell reports it
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
