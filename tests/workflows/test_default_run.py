"""Issue 19, first impression: the default run learns, the console is quiet and readable,
the CLI explains itself, and TensorBoard has per-step curves for every metric."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

from tests.helpers import savedmodel_zoo as zoo
from tests.helpers.config import compose_run
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer import train
from trainer.cli.app import build_parser
from trainer.cli.app import main as cli_main
from trainer.console import StartupFilter
from trainer.models import build_resnet
from trainer.save_backends import get_backend
from trainer.state import TrainingState

# What must never reach a user's console: C++ start-up lines, TensorFlow's and absl's
# INFO lines (and the temporary directories they name), TensorFlow's own log format.
NOISE = re.compile(
    r"absl::InitializeLog|cudart_stub|cuInit|oneDNN|INFO:tensorflow|\]\[absl\]|"
    r"\]\[tensorflow\]\[INFO\]|unsupported characters|\.tmp-\d+-"
)
LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[[\w.]+\]\[[A-Z]+\] - ")


def user_env() -> dict[str, str]:
    """A user's environment: no TF_CPP_MIN_LOG_LEVEL, the entry point has to cope."""
    env = subprocess_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return env


def run(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------ the default run
@pytest.mark.slow
def test_default_run_learns_and_its_console_is_clean(tmp_path):
    """`python train.py` exactly as a new user runs it (only the run directory moved)."""
    result = run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path}"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    final = re.search(r"Final metrics: val_accuracy=([\d.]+)", console)
    assert final is not None, console[-3000:]
    assert float(final.group(1)) >= 0.95
    assert [m.group(0) for m in NOISE.finditer(console)] == []
    # Every log line starts a line of its own: none lands inside a progress bar.
    for match in LOG_LINE.finditer(result.stdout):
        assert match.start() == 0 or result.stdout[match.start() - 1] == "\n", result.stdout[
            max(0, match.start() - 200) : match.end() + 80
        ]
    messages = [line for line in result.stdout.splitlines() if LOG_LINE.match(line)]
    assert len(messages) == len(set(messages))  # nothing printed twice
    assert sum("Saved checkpoint" in m for m in messages) == 5
    # Epochs are numbered out of the whole run, the first one included.
    assert [int(n) for n in re.findall(r"Epoch (\d+)/5\b", result.stdout)] == [1, 2, 3, 4, 5]
    assert result.stderr.strip() == ""
    # The console is a pipe here, as in `| tee log` or a batch job: one plain line per
    # epoch, no terminal control (Keras drew its live bar on any POSIX system: \r and
    # backspaces before every update, ANSI colours, issue 39 item 10).
    assert not re.search(r"\x1b\[|\x08|\r", result.stdout), repr(result.stdout[:600])
    bars = re.findall(r"^\d+/\d+ - \d+s - .*loss: [\d.]+.*$", result.stdout, re.MULTILINE)
    assert len(bars) == 5, result.stdout[-3000:]


def test_default_config_trains_the_nested_custom_block_with_a_schedule(compose_cfg):
    cfg = compose_cfg(tiny=False)
    assert cfg.model._target_ == "trainer.models.build_resnet"  # over ResidualBlock layers
    assert cfg.schedule._target_ == "keras.optimizers.schedules.CosineDecay"
    assert cfg.data._target_ == "trainer.data.load_digits"


# ------------------------------------------------------------------------ log noise
def test_savedmodel_save_logs_no_renamed_inputs(tmp_path, caplog):
    """The serving signature's captured variables get valid names: no absl INFO line
    about renaming them at every full save."""
    model = build_resnet((8, 8, 1), 3, blocks=1, width=4)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with caplog.at_level(logging.INFO, logger="absl"):
        path = get_backend("savedmodel").save(model, tmp_path / "ckpt", state=TrainingState())
    renamed = [r.getMessage() for r in caplog.records if "unsupported characters" in r.getMessage()]
    assert renamed == []
    import tensorflow as tf

    x = np.random.default_rng(0).random((2, 8, 8, 1), dtype=np.float32)
    served = tf.saved_model.load(str(path)).signatures["serving_default"](image=tf.constant(x))
    np.testing.assert_allclose(served["logits"].numpy(), model(x).numpy(), atol=1e-6)


def test_startup_filter_keeps_what_matters():
    line_filter = StartupFilter()
    assert line_filter.keep("E0000 00:00:1.0 1 some_kernel.cc:1] a real error")
    assert line_filter.keep("E0000 cuda_platform.cc:52] failed call to cuInit: driver broken")
    assert not line_filter.keep("I0000 cudart_stub.cc:31] Could not find cuda drivers on ...")
    # With no driver at all, cuInit failing is expected: dropped from then on.
    assert not line_filter.keep("E0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN")
    assert not line_filter.keep(
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    )
    assert line_filter.keep("UserWarning: something the user should know")


def test_filtered_stderr_passes_other_lines_through(tmp_path):
    script = textwrap.dedent(
        """
        import os
        from trainer.console import StartupFilter, filtered_stderr
        with filtered_stderr(StartupFilter()):
            os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called"
                        b" are written to STDERR\\nkept: a real warning\\n")
            os.write(2, b"I0000 cudart_stub.cc:31] Could not find cuda drivers\\n")
            os.write(2, b"no newline at the end")
        os.write(2, b"\\nafter: shown\\n")
        """
    )
    result = run([sys.executable, "-c", script], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "kept: a real warning\nno newline at the end\nafter: shown\n"


def test_entry_point_quiets_tensorflow_and_keeps_its_warnings(tmp_path):
    script = textwrap.dedent(
        """
        import logging
        from trainer.console import quiet_tensorflow
        quiet_tensorflow()
        import tensorflow as tf
        logging.basicConfig(level=logging.INFO, format="%(name)s:%(levelname)s:%(message)s")
        tf.get_logger().info("an info line")
        tf.get_logger().warning("a warning that matters")
        logging.getLogger("absl").info("absl info")
        """
    )
    result = run([sys.executable, "-c", script], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["tensorflow:WARNING:a warning that matters"]


# ------------------------------------------------------------------------------ CLI
def test_usage_names_the_command_that_was_run(tmp_path):
    module = run([sys.executable, "-m", "trainer", "inspect"], tmp_path, timeout=120)
    assert module.returncode == 2
    assert module.stderr.startswith("usage: python -m trainer inspect ")
    script = Path(sys.executable).parent / "trainer"
    if not script.is_file():
        pytest.skip(f"no console script installed next to {sys.executable}")
    console = run([sys.executable, str(script), "--help"], tmp_path, timeout=120)
    assert console.returncode == 0
    assert console.stdout.startswith("usage: trainer ")


def _all_parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


def test_help_is_plain_text_with_every_argument_described_and_examples():
    parser = build_parser("trainer")
    parsers = list(_all_parsers(parser))
    assert [p.prog for p in parsers[1:]] == [
        "trainer inspect",
        "trainer verify",
        "trainer export",
        "trainer import-legacy",
        "trainer runs",
    ]
    for sub in parsers:
        text = sub.format_help()
        assert "``" not in text and ":class:" not in text, text
        assert re.search(r"examples?:\n  trainer [\w-]+ ", text), text
        for action in sub._actions:
            assert action.help, f"{sub.prog}: {action.dest} has no description"


# ------------------------------------------------- inspect / verify on the wrong path
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One run for the tests below, which only point the commands at it (once per test
    it cost a training run each)."""
    run = tmp_path_factory.mktemp("default") / "run"
    train(compose_run(run, "model=mlp", "save=h5"))
    return run


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_run_directory_points_at_latest_and_runs(run_dir, capsys, command):
    assert cli_main([command, str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert f"{run_dir / 'checkpoints' / 'latest'}" in error
    assert f"python -m trainer runs {run_dir}" in error
    assert "tf.saved_model.load" not in error
    assert "third-party" not in error  # it says what the path is (issue 39, item 8)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_checkpoints_folder_points_at_latest(run_dir, capsys, command):
    folder = run_dir / "checkpoints"
    assert cli_main([command, str(folder)]) == 2
    error = capsys.readouterr().err
    assert "folder of checkpoints" in error and f"{folder / 'latest'} (the newest)" in error
    assert "tf.saved_model.load" not in error
    assert "third-party" not in error  # it says what the path is (issue 39, item 8)


def test_entry_point_error_is_one_line_with_the_hint(run_dir):
    result = run([sys.executable, "-m", "trainer", "inspect", str(run_dir)], run_dir, 600)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "checkpoints/latest" in result.stderr


def _small_model() -> keras.Model:
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.keras", "keras.saving.load_model("),
        ("model.h5", "keras.saving.load_model("),
        ("model.weights.h5", "model.load_weights("),
    ],
)
def test_foreign_files_get_advice_for_their_format(tmp_path, capsys, name, expected):
    model = _small_model()
    path = tmp_path / name
    if name.endswith(".weights.h5"):
        model.save_weights(path)
    else:
        model.save(path)
    for command in ("inspect", "verify"):
        assert cli_main([command, str(path)]) == 2
        error = capsys.readouterr().err
        assert expected in error and "tf.saved_model.load" not in error, error


def test_plain_savedmodel_still_gets_the_savedmodel_advice(tmp_path, capsys):
    model = _small_model()
    model.export(tmp_path / "exported", format="tf_saved_model", verbose=False)
    assert cli_main(["inspect", str(tmp_path / "exported")]) == 2
    assert "tf.saved_model.load" in capsys.readouterr().err


# ---------------------------------------------------- inspect marks traced revivals
def test_inspect_marks_layers_revived_from_traced_functions(tmp_path, capsys):
    model = build_resnet((8, 8, 1), 3, blocks=2, width=4)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt", state=TrainingState())
    with zoo.classes_hidden(["ResidualBlock"], package="trainer"):
        assert cli_main(["inspect", str(path), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert cli_main(["inspect", str(path)]) == 0
        text = capsys.readouterr().out
    how = {node["name"]: node.get("revived_from") for node in report["layers"]}
    assert how["block0"] == how["block1"] == "traced"
    assert how["stem"] == how["logits"] == "config"
    marked = [line for line in text.splitlines() if "revived from traced functions" in line]
    assert [line.split("(")[0].strip(" -") for line in marked] == ["block0", "block1"]
    (summary,) = [line for line in text.splitlines() if line.startswith("revived:")]
    assert summary.endswith("from traced functions, not from their class: block0, block1")
    # With the class importable, nothing is marked.
    assert cli_main(["inspect", str(path)]) == 0
    assert "traced" not in capsys.readouterr().out


# ------------------------------------------------------ TensorBoard per-step scalars
def test_per_step_scalars_for_every_metric_and_the_learning_rate(compose_cfg, tmp_path):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    cfg = compose_cfg("model=mlp", "save=h5", "schedule=cosine", "optimizer.learning_rate=0.02")
    train(cfg)
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"batch/loss", "batch/accuracy", "batch/learning_rate"} <= tags

    def series(tag):
        values = events.Tensors(tag)
        return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in values}

    steps = cfg.trainer.epochs * cfg.trainer.steps_per_epoch
    for tag in ("batch/loss", "batch/accuracy", "batch/learning_rate"):
        assert sorted(series(tag)) == list(range(1, steps + 1)), tag
    # The rate each step used: the cosine schedule at the steps before it.
    schedule = keras.optimizers.schedules.CosineDecay(0.02, decay_steps=steps)
    expected = [float(schedule(step - 1)) for step in range(1, steps + 1)]
    np.testing.assert_allclose(list(series("batch/learning_rate").values()), expected, rtol=1e-6)
    # At an epoch's last step the running means are the epoch's metrics.
    for step in (cfg.trainer.steps_per_epoch, steps):
        for metric in ("loss", "accuracy"):
            assert series(f"batch/{metric}")[step] == pytest.approx(
                series(f"epoch/{metric}")[step], rel=1e-6
            )


def test_python_next_to_a_clone_named_trainer_imports_the_package(tmp_path):
    """Issue 19 item 6: with the package in src/, an installed (or editable) trainer wins
    over a directory named ``trainer`` in the working directory (here the clone itself),
    which Python would otherwise import as an empty namespace package."""
    (tmp_path / "trainer").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}  # as installed
    code = "import trainer; print(trainer.__file__); print(trainer.__version__)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    where, version = result.stdout.split()
    assert Path(where).name == "__init__.py" and Path(where).parent.parent.name == "src"
    assert version == __import__("trainer").__version__
