"""Third-party save backends registered through the entry-point group
``trainer.save_backends`` (issue 16, item 11, registry part).

No mocks and no network: a real installed distribution is a ``*.dist-info`` directory with
``METADATA`` and ``entry_points.txt`` on a ``sys.path`` entry, which ``importlib.metadata``
finds like any pip-installed one. Children get it on their PYTHONPATH; the checkpoints are
written here, by the example backend (tests/example_backend/mybackend.py) and by a
directory variant of it, as ``save._target_`` would select them: no registration at all.
Before entry-point support, every read in the children failed with "not a checkpoint in any
registered format".
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer.state import TrainingState

EXAMPLE_DIR = ROOT / "tests" / "example_backend"

DIR_BACKEND = '''
from pathlib import Path

from mybackend import NpzBackend


class NpzDirBackend(NpzBackend):
    """The example's npz as ``model.npz`` inside a directory checkpoint (with a manifest)."""

    name = "npzdir"
    is_directory = True
    suffix = ""

    @classmethod
    def can_load(cls, path):
        return Path(path).is_dir() and NpzBackend.can_load(Path(path) / "model.npz")

    def _write(self, model, tmp, state, metadata):
        super()._write(model, Path(tmp) / "model.npz", state, metadata)

    def _read(self, path, *, custom_objects, compile, safe_mode):
        checkpoint = super()._read(
            Path(path) / "model.npz",
            custom_objects=custom_objects,
            compile=compile,
            safe_mode=safe_mode,
        )
        checkpoint.path = Path(path)
        return checkpoint
'''

ENTRY_POINTS = """
[trainer.save_backends]
broken = trainer_no_such_module:Backend
npz = mybackend:NpzBackend
npzdir = dirbackend:NpzDirBackend
"""

# Runs in the children: every way trainer looks a backend up, in an order that shows
# the entry points stay unimported until one of their checkpoints is read.
CHILD = """
import json, sys
import numpy as np
from trainer.errors import TrainerError
from trainer.save_backends import available_backends, get_backend, load_checkpoint

paths = json.loads(sys.argv[1])
out = {"names": sorted(available_backends())}
load_checkpoint(paths["weights"])
out["imported_after_builtin"] = sorted(m for m in ("mybackend", "dirbackend") if m in sys.modules)
x = np.asarray(json.loads(sys.argv[2]), "float32")
for key in ("npz", "npzdir"):
    try:
        checkpoint = load_checkpoint(paths[key])
        out[key] = {
            "backend": checkpoint.metadata["backend"],
            "class": type(checkpoint.model).__name__,
            "epoch": checkpoint.state.epoch,
            "outputs": np.asarray(checkpoint.model(x)).tolist(),
        }
    except TrainerError as error:
        out[key] = {"error": type(error).__name__, "message": str(error)}
out["imported_at_end"] = sorted(m for m in ("mybackend", "dirbackend") if m in sys.modules)
for name in ("no-such-backend", "broken"):
    try:
        get_backend(name)
    except TrainerError as error:
        out[name] = {
            "error": type(error).__name__,
            "is_import_error": isinstance(error, ImportError),
            "message": str(error),
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of the three kinds, and the model's outputs on a batch."""
    root = tmp_path_factory.mktemp("entry_points")
    modules = root / "modules"
    modules.mkdir()
    (modules / "dirbackend.py").write_text(textwrap.dedent(DIR_BACKEND))
    sys.path[:0] = [str(EXAMPLE_DIR), str(modules)]
    try:
        import dirbackend
        import mybackend

        from trainer.save_backends import get_backend

        model = small_trained_model()
        checkpoints = root / "run" / "checkpoints"
        state = TrainingState(epoch=1, global_step=4)
        paths = {
            "weights": get_backend("weights").save(model, root / "builtin", state=state),
            "npz": mybackend.NpzBackend().save(model, checkpoints / "step-4", state=state),
            "npzdir": dirbackend.NpzDirBackend().save(model, root / "dir" / "step-4", state=state),
        }
    finally:
        del sys.path[:2]
        sys.modules.pop("dirbackend", None)
        sys.modules.pop("mybackend", None)
    x = np.random.default_rng(1).normal(size=(4, 6)).astype("float32")
    return {
        "root": root,
        "modules": modules,
        "paths": {k: str(v) for k, v in paths.items()},
        "x": x,
        "expected": np.asarray(model(x)),
    }


def small_trained_model():
    """The contract suite's Sequential model (built-in Keras classes only: the CLI children
    must rebuild it without test code), after one epoch."""
    from trainer import testing

    model = testing.build_model("sequential")
    testing.train(model, "sequential")
    return model


def child_env(saved, *, installed: bool) -> dict[str, str]:
    """The modules importable; with ``installed``, the distribution declaring them too."""
    env = subprocess_env()
    extra = [str(EXAMPLE_DIR), str(saved["modules"])]
    if installed:
        site = saved["root"] / "site"
        info = site / "trainer_example_backends-0.1.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: trainer-example-backends\nVersion: 0.1\n"
        )
        (info / "entry_points.txt").write_text(ENTRY_POINTS)
        extra.append(str(site))
    env["PYTHONPATH"] = ":".join([env["PYTHONPATH"], *extra])
    return env


def run_child(saved, *, installed: bool) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(saved["paths"]), json.dumps(saved["x"].tolist())],
        env=child_env(saved, installed=installed),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_installed_entry_points_load_target_written_checkpoints(saved):
    result = run_child(saved, installed=True)
    assert {"broken", "npz", "npzdir", "savedmodel", "h5", "weights"} <= set(result["names"])
    assert result["imported_after_builtin"] == []  # lazy: a built-in format needs none
    for key in ("npz", "npzdir"):
        loaded = result[key]
        assert "error" not in loaded, loaded
        assert loaded["backend"] == key and loaded["epoch"] == 1
        np.testing.assert_array_equal(np.asarray(loaded["outputs"], "float32"), saved["expected"])
    assert result["imported_at_end"] == ["dirbackend", "mybackend"]
    unknown = result["no-such-backend"]
    assert unknown["error"] == "UnknownBackendError"
    assert "Valid names: broken, h5, npz, npzdir, savedmodel, weights." in unknown["message"]
    assert "'trainer.save_backends'" in unknown["message"]  # how to register one
    broken = result["broken"]
    assert broken["error"] == "BackendUnavailableError" and broken["is_import_error"]
    assert "trainer-example-backends" in broken["message"]  # which distribution declares it
    assert "trainer_no_such_module" in broken["message"]


def test_unregistered_backends_are_refused_without_importing_them(saved):
    """Importable but not registered: never imported from what a checkpoint records."""
    result = run_child(saved, installed=False)
    assert result["imported_at_end"] == []
    npz = result["npz"]  # a single file: nothing readable names its backend
    assert npz["error"] == "NotACheckpointError"
    assert "'trainer.save_backends'" in npz["message"] and "register_backend" in npz["message"]
    npzdir = result["npzdir"]  # its manifest records the backend and its class
    assert npzdir["error"] == "NotACheckpointError", npzdir
    assert "register_backend('npzdir', 'dirbackend:NpzDirBackend')" in npzdir["message"]
    assert "`npzdir = dirbackend:NpzDirBackend`" in npzdir["message"]
    assert npzdir["message"].endswith("Received: backend 'npzdir'")


# The CLI commands, each through ``trainer.cli.main`` as ``python -m trainer`` calls it,
# one after the other in ONE child with the distribution installed (a child per command
# only added a TensorFlow import each). The first command to read each backend's
# checkpoint resolves its entry point; the child is fresh, so none is imported before.
CLI_CHILD = """
import contextlib, io, json, sys
from trainer.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv, prog="python -m trainer")
    results.append({"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def cli_results(saved):
    """``(command, target) -> (exit code, stdout, stderr)`` of every CLI call the tests check."""
    calls = [
        [command, saved["paths"][key], "--json"]
        for command in ("inspect", "verify")
        for key in ("npz", "npzdir")
    ]
    calls.append(["runs", str(saved["root"] / "run"), "--json"])
    done = subprocess.run(
        [sys.executable, "-c", CLI_CHILD, json.dumps(calls)],
        env=child_env(saved, installed=True),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {(r["argv"][0], r["argv"][1]): (r["code"], r["stdout"], r["stderr"]) for r in results}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_reads_entry_point_backends(saved, cli_results, command):
    for key in ("npz", "npzdir"):
        code, stdout, stderr = cli_results[(command, saved["paths"][key])]
        assert code == 0, (key, stdout[-2000:], stderr[-2000:])
        assert key in stdout


@pytest.mark.slow
def test_runs_lists_entry_point_checkpoints(saved, cli_results):
    code, stdout, stderr = cli_results[("runs", str(saved["root"] / "run"))]
    assert code == 0, stderr[-2000:]
    [run] = json.loads(stdout)["runs"]
    [entry] = run["checkpoints"]
    assert "error" not in entry, entry  # before: "not a checkpoint in any registered format"
    assert (entry["name"], entry["backend"], entry["step"]) == ("step-4.npz", "npz", 4)
