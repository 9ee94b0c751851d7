"""One value per default (issue 15, item 7 in spirit): what the code does when a key is left
out equals what conf/ writes, and a checkpoint name pattern that some save could not fill is
refused before training starts."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from conftest import CONF_DIR
from omegaconf import OmegaConf

from trainer import export, train
from trainer.checkpointing import CheckpointPolicy
from trainer.errors import ConfigError
from trainer.save_backends import load_checkpoint
from trainer.wrapping import pruning


def yaml(path: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / path), resolve=True)


def test_checkpoint_policy_defaults_are_the_yaml_ones():
    policy = yaml("checkpoint/default.yaml")["policy"]
    code = {f.name: f.default for f in dataclasses.fields(CheckpointPolicy)}
    assert policy == code


def test_pruning_defaults_are_the_yaml_ones():
    options = {k: v for k, v in yaml("wrap/prune.yaml").items() if k != "kind"}
    defaults = pruning.CONFIG_DEFAULTS
    assert options.keys() == defaults.keys()
    for key, value in options.items():
        assert value == (list(defaults[key]) if isinstance(value, list) else defaults[key]), key
    schedule = inspect.signature(pruning.PruneLowMagnitude).parameters["frequency"].default
    assert schedule == options["frequency"] == pruning.PolynomialSparsity(0.5).frequency


def test_export_keep_is_written_once():
    assert yaml("export/default.yaml")["keep"] == export.DEFAULT_KEEP
    for function in (export.export_serving, export.export_from_checkpoint):
        assert inspect.signature(function).parameters["keep"].default == export.DEFAULT_KEEP


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ([], r"\{val_loss\}, which step and interrupt saves"),
        (["checkpoint.policy.on_interrupt=false", "checkpoint.policy.every_n_steps=5"], "step"),
        (["checkpoint.policy.on_interrupt=false", "trainer.validation_split=0"], "no validation"),
    ],
)
def test_a_validation_metric_in_the_name_is_refused_before_training(
    compose_cfg, tmp_path, overrides, match
):
    name = "checkpoint.policy.name='epoch-{epoch:03d}-{val_loss:.3f}'"
    with pytest.raises(ConfigError, match=match):
        train(compose_cfg("model=mlp", "save=h5", name, *overrides))
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("name", "match"),
    [("{vall_loss}", r"\{vall_loss\}, which no save knows"), ("{step:zz}", "format pattern")],
)
def test_an_unknown_or_malformed_placeholder_is_refused(name, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointPolicy(name=name).check_name(["loss", "accuracy"], validation=True)


def test_validation_names_work_when_every_save_is_an_epoch_end(compose_cfg, tmp_path):
    """The documented pattern, with the policy that makes it valid; a SIGTERM mid-epoch then
    stops without an interrupt save instead of crashing with a KeyError."""
    train(
        compose_cfg(
            "model=mlp",
            "save=h5",
            "checkpoint.policy.name='epoch-{epoch:03d}-{val_loss:.3f}-{loss:.2f}'",
            "checkpoint.policy.on_interrupt=false",
            "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}",
        )
    )
    (saved,) = [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name != "latest"]
    assert saved.name.startswith("epoch-001-") and load_checkpoint(saved).state.epoch == 1
