"""Serving exports without the optimizer (issue 17): an export holds the model's variables
only, unless asked for the optimizer (``with_optimizer`` / ``--with-optimizer`` /
``export.with_optimizer=true``), and still serves exactly what the model computes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from trainer import testing, train
from trainer.cli.app import main as cli_main
from trainer.errors import ExportError
from trainer.exports.exporter import export_serving, read_export_metadata
from trainer.save_backends import get_backend, load_checkpoint


def trained_model():
    """The contract suite's Sequential regression model after one epoch (Adam slots filled)."""
    model = testing.build_model("sequential")
    testing.train(model, "sequential")
    return model, testing.suite_data("sequential")[0]


def stored_keys(version_dir) -> list[str]:
    """The names of the variables in the export's ``variables/`` checkpoint."""
    reader = tf.train.load_checkpoint(str(version_dir / "variables" / "variables"))
    return sorted(reader.get_variable_to_shape_map())


def served(version_dir, x) -> np.ndarray:
    serve = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    (output,) = serve(tf.constant(x)).values()
    return output.numpy()


def test_an_export_holds_no_optimizer_variables_and_serves_the_same(tmp_path):
    model, x = trained_model()
    version = export_serving(model, tmp_path / "export")
    keys = stored_keys(version)
    assert keys and not [k for k in keys if k.startswith("optimizer_variables")]
    np.testing.assert_array_equal(served(version, x), model.predict(x, verbose=0))
    assert read_export_metadata(version)["with_optimizer"] is False
    revived = load_checkpoint(version).model  # an inference model: no compile state
    assert not revived.compiled
    np.testing.assert_array_equal(revived.predict(x, verbose=0), model.predict(x, verbose=0))
    # The checkpoint of the same model keeps the optimizer: the export's choice is its own.
    checkpoint = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert [k for k in stored_keys(checkpoint) if k.startswith("optimizer_variables")]


def test_with_optimizer_keeps_the_slots_and_the_compile_state(tmp_path):
    model, x = trained_model()
    version = export_serving(model, tmp_path / "export", with_optimizer=True)
    slots = [k for k in stored_keys(version) if k.startswith("optimizer_variables")]
    assert len(slots) == len(model.optimizer.variables)
    revived = load_checkpoint(version).model
    assert revived.compiled
    for mine, theirs in zip(model.optimizer.variables, revived.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    np.testing.assert_array_equal(served(version, x), model.predict(x, verbose=0))
    with pytest.raises(ExportError, match="format=keras export is inference-only"):
        export_serving(model, tmp_path / "lean", format="keras", with_optimizer=True)


def test_run_end_and_cli_exports_leave_the_optimizer_out_unless_asked(compose_cfg, capsys):
    cfg = compose_cfg("model=mlp", "save=h5", "export.enabled=true", "export.warmup_examples=0")
    train(cfg)
    run_dir = Path(cfg.run_dir)
    (version,) = sorted((run_dir / "export").iterdir())
    assert not [k for k in stored_keys(version) if k.startswith("optimizer_variables")]
    # The CLI's default is the same export (the checkpoint is loaded uncompiled); asked
    # for, it keeps the slots of the checkpoint's optimizer.
    latest = run_dir / "checkpoints" / "latest"
    out = run_dir / "cli"
    assert cli_main(["export", str(latest), str(out), "--json", "--with-optimizer"]) == 0
    exported = Path(json.loads(capsys.readouterr().out)["export"])
    assert [k for k in stored_keys(exported) if k.startswith("optimizer_variables")]
    assert read_export_metadata(exported)["with_optimizer"] is True
