"""The parent side of the peer suites (``tests/save_backends/test_keras_peer_suites.py``
and ``test_keras_layer_peer_suite.py``): run Keras's installed test modules in a child
pytest with one of this folder's routing plugins, and match report keys to the
expectations files' entries.

Imported by the tests as ``tests.peer.child_runs``; the children import this folder's
plugins as top-level modules (it is put first on their ``PYTHONPATH``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.paths import ROOT

PEER_DIR = ROOT / "tests" / "peer"


def lookup(table: dict, key: str):
    """``(pattern, entry)`` of ``table`` whose key is ``key`` or an fnmatch pattern matching
    it; ``(None, None)`` if none does."""
    if key in table:
        return key, table[key]
    for pattern, value in table.items():
        if fnmatch.fnmatchcase(key, pattern):
            return pattern, value
    return None, None


def run_child(
    plugin: str,
    selection: list[str],
    workdir: Path,
    *,
    env: dict[str, str],
    report_path: Path,
    timeout: float,
    extra_args: list[str] = (),
) -> tuple[dict, float, str]:
    """``python -m pytest -p plugin --pyargs selection`` in ``workdir`` with ``env`` added;
    return (the JSON report the plugin wrote at ``report_path``, seconds, the log's tail).

    Only this repository's plugin is loaded: a bare ``pytest.ini`` keeps our own pytest
    configuration out of the child."""
    ini = workdir / "pytest.ini"
    # Keras's markers are registered by its repository's conftest, not shipped in the wheel.
    ini.write_text("[pytest]\nmarkers =\n    requires_trainable_backend: Keras marker\n")
    child_env = dict(os.environ)
    child_env.update(env, TF_CPP_MIN_LOG_LEVEL="3")
    child_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(PEER_DIR), str(ROOT), os.environ.get("PYTHONPATH")])
    )
    command = [sys.executable, "-m", "pytest", "-p", plugin, "--pyargs", *selection]
    command += ["-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(workdir)]
    command += list(extra_args)
    started = time.monotonic()
    result = subprocess.run(
        command, cwd=workdir, env=child_env, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.monotonic() - started
    log = result.stdout[-6000:] + result.stderr[-3000:]
    # 0: all passed, 1: some tests failed (the caller classifies them); else a crash.
    assert result.returncode in (0, 1), f"child pytest exited {result.returncode}:\n{log}"
    assert report_path.exists(), f"the {plugin} plugin wrote no report:\n{log}"
    return json.loads(report_path.read_text()), seconds, log
