"""The tf_keras fixtures both legacy modules read, written once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.paths import CHILDREN_DIR
from tests.helpers.processes import written_once

WRITERS = CHILDREN_DIR / "legacy_writers.py"


@pytest.fixture(scope="session")
def legacy_written(tmp_path_factory) -> Path:
    """``zoo/`` (``test_import_zoo.py``) and ``state/`` (``test_state_beyond_weights.py``),
    written by ONE tf_keras process per test run (``tests.helpers.processes.written_once``):
    one TensorFlow and tf_keras import for both modules, whichever runs first."""
    return written_once(tmp_path_factory, "legacy", WRITERS)
