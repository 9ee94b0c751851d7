"""One value per default (issue 15 item 7): the config groups whose defaults live in code
extend Hydra structured configs (trainer.training.config) and write no value of their own; composing
checks types and keys; a checkpoint name pattern that some save could not fill is refused
before training starts."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import trainer.training.config
from tests.helpers.paths import CONF_DIR
from trainer import train
from trainer.checkpointing import CheckpointPolicy
from trainer.errors import ConfigError
from trainer.exports import exporter, sources
from trainer.save_backends import load_checkpoint
from trainer.wrapping import pruning


def yaml(path: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / path), resolve=True)


SCHEMA_GROUPS = [
    "checkpoint/default",
    "export/default",
    "trainer/default",
    "wrap/none",
    "wrap/prune",
    "strategy/default",
    "strategy/mirrored",
    "strategy/multiworker",
]


@pytest.mark.parametrize("option", SCHEMA_GROUPS)
def test_group_yaml_extends_its_schema_and_writes_no_value_of_its_own(option):
    group, name = option.split("/")
    schema = "schema" if group in ("checkpoint", "export", "trainer") else f"schema_{name}"
    assert yaml(f"{option}.yaml") == {"defaults": [schema, "_self_"]}
    assert schema in trainer.training.config.SCHEMAS[group]


def test_composed_defaults_are_the_code_ones(compose_cfg):
    cfg = compose_cfg("wrap=prune", tiny=False)
    policy = {f.name: f.default for f in dataclasses.fields(CheckpointPolicy)}
    assert OmegaConf.to_container(cfg.checkpoint.policy) == policy
    wrap = OmegaConf.to_container(cfg.wrap)
    assert wrap.pop("kind") == "prune"
    code = pruning.CONFIG_DEFAULTS
    assert wrap == {k: list(v) if isinstance(v, tuple) else v for k, v in code.items()}
    schedule = inspect.signature(pruning.PruneLowMagnitude).parameters["frequency"].default
    assert schedule == wrap["frequency"] == pruning.PolynomialSparsity(0.5).frequency
    assert cfg.export.keep == exporter.DEFAULT_KEEP
    for function in (exporter.export_serving, sources.export_from_checkpoint):
        assert inspect.signature(function).parameters["keep"].default == exporter.DEFAULT_KEEP


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("trainer.epochs=abc", r"trainer.epochs"),
        ("checkpoint.policy.keep_lst=2", r"keep_lst"),
        ("exporter.keep=1.5", r"exporter.keep"),
        ("wrap=prune wrap.power=fast", r"wrap.power"),
        ("strategy=mirrored strategy.logical_cpus=two", r"strategy.logical_cpus"),
    ],
)
def test_a_wrong_type_or_unknown_key_fails_when_composing(compose_cfg, override, match):
    with pytest.raises(ConfigCompositionException) as raised:
        compose_cfg(*override.split())
    assert re.search(match, str(raised.value) + str(raised.value.__cause__)), raised.value


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
