"""The package's shape, as a user meets it: a light root, and every ``_target_`` resolves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.helpers.paths import ROOT

HEAVY = ("tensorflow", "keras", "hydra", "omegaconf", "tensorboard", "sklearn", "h5py")


@pytest.mark.parametrize(
    "statement", ["import trainer", "import trainer.errors", "import trainer.cli.app"]
)
def test_light_modules_import_no_heavy_dependency(statement):
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert not loaded & set(HEAVY), f"{statement} imported {sorted(loaded & set(HEAVY))}"


def test_train_is_still_reachable_from_the_package_root():
    import trainer

    assert callable(trainer.train) and trainer.train.__module__ == "trainer.training.loop"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        trainer.nope  # noqa: B018


def test_cli_help_answers_without_loading_tensorflow():
    code = (
        "import sys, runpy\nsys.argv = ['trainer', '--help']\n"
        "try:\n    runpy.run_module('trainer', run_name='__main__')\n"
        "except SystemExit as stop:\n    assert stop.code == 0, stop.code\n"
        "assert 'tensorflow' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "inspect" in out.stdout and "export" in out.stdout


def _targets(node):
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield node["_target_"]
        for value in node.values():
            yield from _targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from _targets(value)


def test_every_target_in_the_shipped_config_resolves():
    from hydra.utils import get_object

    targets = sorted(
        {
            t
            for path in (ROOT / "conf").rglob("*.yaml")
            for t in _targets(yaml.safe_load(path.read_text()))
        }
    )
    assert "trainer.save_backends.savedmodel.SavedModelBackend" in targets
    for target in targets:
        assert callable(get_object(target)), target
