"""Child processes of tests: their environment, and fixture writers run once per test
run."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import PLUGINS_DIR, ROOT


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
