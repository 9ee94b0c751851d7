"""Where things are: the repository, its Hydra config, and the test folders that hold no
test modules (scripts run as child processes, plugins selected from config)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/paths.py -> the repository
CONF_DIR = ROOT / "conf"
# Scripts tests start as child processes: ``[sys.executable, str(CHILDREN_DIR / NAME)]``.
CHILDREN_DIR = ROOT / "tests" / "children"
# Test-only modules that runs select from config (fault injection: ``faults.SignalAtStep``
# as a callback, ``faults.slow_backend`` as ``save._target_``). Importable in the tests
# (``tests/conftest.py`` puts the folder on ``sys.path``) and in the child processes started
# with ``subprocess_env()``; never part of the product package.
PLUGINS_DIR = ROOT / "tests" / "plugins"
