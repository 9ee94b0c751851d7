"""``python train.py ...`` in a child process, for the tests of whole sessions and sweeps;
a warm one (``tests.helpers.warm``) where a fork is faithful."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers import warm
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env

# A tiny run of 2 epochs of 3 batches.
TINY_ARGS = [
    "model=mlp",
    "data=synthetic",
    "save=weights",  # the quickest backend; the backends have tests of their own
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "trainer.steps_per_epoch=3",
    "trainer.verbose=0",
    "export.enabled=false",
]
HANG_GUARD = 300  # seconds; only against a hung child, never asserted as a duration


def train_py(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None):
    """Run ``python train.py ARGS`` to the end; stdout and stderr together in ``.output``."""
    proc = warm.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd, env=env or subprocess_env(), capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    proc.output = proc.stdout + proc.stderr
    return proc
