"""Shared fixtures: Hydra driven through ``compose`` with tiny overrides, outputs in tmp_path."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import trainer.training.config  # noqa: F401  (registers the config schemas conf/ extends)

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
# Test-only modules that runs select from config (fault injection: ``faults.SignalAtStep``
# as a callback, ``faults.slow_backend`` as ``save._target_``). Importable here and in the
# child processes started with ``subprocess_env()``; never part of the product package.
PLUGINS_DIR = ROOT / "tests" / "plugins"
if str(PLUGINS_DIR) not in sys.path:
    sys.path.insert(0, str(PLUGINS_DIR))

# Small enough that a whole training run takes a second or two on 2 cores.
TINY = [
    "data=synthetic",
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "trainer.steps_per_epoch=3",
    "trainer.verbose=0",
    "export.enabled=false",  # the serving export has tests of its own
]


@pytest.fixture
def compose_cfg(tmp_path):
    """``compose_cfg(*overrides)`` -> the run config with tiny defaults, writing to tmp_path."""

    def _compose(*overrides: str, tiny: bool = True):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            return compose(
                "config",
                overrides=[*(TINY if tiny else []), f"run_dir={tmp_path / 'run'}", *overrides],
            )

    return _compose


def config_options(group: str) -> list[str]:
    """Every option of a config group, read from ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory`` (no temporaries, no ``latest`` pointer), by name."""
    return sorted(p for p in directory.iterdir() if p.name[0] != "." and p.name != "latest")


def subprocess_env() -> dict[str, str]:
    """Environment for child Python processes: quiet TensorFlow, project and the test
    plugins (``PLUGINS_DIR``) importable."""
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    paths = [str(ROOT / "src"), str(ROOT), str(PLUGINS_DIR), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def written_once(tmp_path_factory, name: str, script: Path) -> Path:
    """``python script OUT`` run once per test run (the tf_keras fixture writers: tf_keras
    is only ever imported in that process), into ``<temporary root>/name``. Under xdist the
    workers share the run's temporary root (each worker's base directory is a child of it),
    and the first worker to get here writes under a lock while the other waits."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "complete").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
            env.pop("KERAS_BACKEND", None)
            done = subprocess.run(
                [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr[-3000:]
            (out / "complete").write_text("written by the first worker\n")
    return out
