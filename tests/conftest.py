"""Shared fixtures: Hydra driven through ``compose`` with tiny overrides, outputs in tmp_path.

Fixtures only: plain helpers are modules of ``tests/helpers/``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest

import trainer.training.config  # noqa: F401  (registers the config schemas conf/ extends)
from tests.helpers.config import compose_run
from tests.helpers.gcs_server import gcs_bucket, gcs_server  # noqa: F401  (one emulator a session)
from tests.helpers.paths import PLUGINS_DIR
from tests.helpers.s3_server import s3_bucket, s3_server  # noqa: F401  (one server a session)

# The test plugins (``faults.SignalAtStep``, ...) importable by the names that runs
# select them with from config; child processes get them from ``subprocess_env()``.
if str(PLUGINS_DIR) not in sys.path:
    sys.path.insert(0, str(PLUGINS_DIR))


@pytest.fixture
def compose_cfg(tmp_path):
    """``compose_cfg(*overrides)`` -> the run config with tiny defaults, writing to tmp_path."""

    def _compose(*overrides: str, tiny: bool = True):
        return compose_run(tmp_path / "run", *overrides, tiny=tiny)

    return _compose


# ----------------------------------------------------------------- the extended tier
EXTENDED = "extended"


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        default=False,
        help="also run the cases marked `extended` (deselected by default): more variants "
        "of behaviours the default suite covers with at least one case each",
    )


def pytest_collection_modifyitems(config, items):
    """Deselect the ``extended`` cases unless ``--extended``: the default suite (CI) keeps
    one representative of every behaviour within its time budget; the extended tier adds
    the costlier variants (docs/how-to/run-the-tests.md lists them and what covers each)."""
    if config.getoption("--extended"):
        return
    extended = [item for item in items if item.get_closest_marker(EXTENDED)]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker(EXTENDED)]
