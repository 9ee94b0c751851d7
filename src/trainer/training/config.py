"""Typed schemas of the config groups whose defaults live in code (Hydra structured configs).

``conf/checkpoint``, ``conf/export``, ``conf/trainer``, ``conf/wrap`` and ``conf/strategy``
extend the dataclasses below (``defaults: [schema, _self_]``) and write no values of their
own, so a default is written once: here, or in the code the field names (the checkpoint
policy, ``export.DEFAULT_KEEP``, ``pruning.CONFIG_DEFAULTS``). Composing checks types and
keys: ``trainer.epochs=abc`` or a misspelt ``checkpoint.policy.keep_lst=2`` fails before
anything runs, naming the key.

The schemas are registered in Hydra's ``ConfigStore`` when this module is imported; that
happens on ``import trainer.training.loop`` (``train.py``). Code that composes ``conf/`` itself
(``hydra.compose`` in a notebook or a test) imports ``trainer.training.config`` first.

    python train.py --cfg job --package checkpoint   # every value, defaults included
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore

from trainer.checkpointing.policy import CheckpointPolicy
from trainer.errors import ConfigError
from trainer.exports.exporter import DEFAULT_KEEP
from trainer.storage.locations import is_remote, local_path
from trainer.storage.store import Store
from trainer.wrapping.pruning import CONFIG_DEFAULTS as PRUNE_DEFAULTS


@dataclasses.dataclass
class CheckpointConfig:
    """``conf/checkpoint``: where checkpoints go and the policy (``CheckpointPolicy``)."""

    directory: str = "checkpoints"  # relative to the run directory
    policy: CheckpointPolicy = dataclasses.field(default_factory=CheckpointPolicy)


@dataclasses.dataclass
class ExportConfig:
    """``conf/export``: the serving export at the end of training."""

    enabled: bool = True
    directory: str = "export"  # relative to the run directory; a model server can watch it
    keep: int = DEFAULT_KEEP  # newest versions kept; older ones are removed
    format: str = "auto"  # auto (savedmodel if importable) | keras (lean) | savedmodel
    # TF Serving warmup requests from validation examples; 0 = none; at most 1000 (TF
    # Serving does not load a version with more)
    warmup_examples: int = 4
    unwrap: bool = False  # export plain layers (pruning masks baked into kernels)
    # Keep the compile state, optimizer slots and per-layer training traces (savedmodel
    # format only); off: a server never trains, the slots double or triple the export's
    # size and the training traces are a third of its time (issue 17).
    with_optimizer: bool = False


@dataclasses.dataclass
class TrainerConfig:
    """``conf/trainer``: how training runs (the seed is top-level: ``seed=...``)."""

    epochs: int = 5
    batch_size: int = 64
    steps_per_epoch: int | None = None  # cap on batches per epoch; None = the whole split
    validation_split: float = 0.2  # fraction held out (seeded) for validation
    deterministic: bool = True  # enable_op_determinism(): bitwise repeatable runs
    # Keras progress: 0 silent, 1 progress bar (a plain line per epoch when stdout is not a
    # terminal: a log file or a pipe gets no control characters), 2 one line per epoch
    verbose: int = 1
    tensorboard_dir: str = "tb"


@dataclasses.dataclass
class NoWrapConfig:
    """``wrap=none``: the model trains and exports exactly as built."""

    kind: str = "none"


def _default(key: str) -> list[str]:
    return list(PRUNE_DEFAULTS[key])


@dataclasses.dataclass
class PruneConfig:
    """``wrap=prune``: magnitude pruning (``trainer.wrapping.pruning``); steps are optimizer
    steps, so a resumed run continues the schedule."""

    kind: str = "prune"
    target_sparsity: float = PRUNE_DEFAULTS["target_sparsity"]
    initial_sparsity: float = PRUNE_DEFAULTS["initial_sparsity"]
    begin_step: int = PRUNE_DEFAULTS["begin_step"]
    end_step: int | None = PRUNE_DEFAULTS["end_step"]  # None = the run's last step
    frequency: int = PRUNE_DEFAULTS["frequency"]  # steps between mask updates
    power: float = PRUNE_DEFAULTS["power"]  # 3 prunes fast early, gently at the end
    layer_types: list[str] = dataclasses.field(default_factory=lambda: _default("layer_types"))
    exclude: list[str] = dataclasses.field(default_factory=lambda: _default("exclude"))


@dataclasses.dataclass
class DefaultStrategyConfig:
    """``strategy=default``: no tf.distribute strategy, one device."""

    kind: str = "default"
    scale_lr: bool = False  # no effect with one replica


@dataclasses.dataclass
class MirroredStrategyConfig:
    """``strategy=mirrored``: synchronous data parallelism over this machine's devices;
    ``trainer.batch_size`` is the global batch."""

    kind: str = "mirrored"
    devices: list[str] | None = None  # None = every local GPU (the CPU if none)
    logical_cpus: int | None = None  # e.g. 2: split the CPU into 2 logical devices
    scale_lr: bool = False  # True = learning rate x replicas (linear scaling rule)


@dataclasses.dataclass
class MultiWorkerStrategyConfig:
    """``strategy=multiworker``: several processes or machines, described by ``TF_CONFIG``;
    the chief writes checkpoints, TensorBoard events and exports."""

    kind: str = "multiworker"
    communication: str = "auto"  # auto | ring | nccl
    timeout_seconds: float | None = None  # give up on a collective after this long
    logical_cpus: int | None = None  # per worker, as in strategy=mirrored
    scale_lr: bool = False


SCHEMAS: dict[str, dict[str, Any]] = {
    "checkpoint": {"schema": CheckpointConfig},
    "export": {"schema": ExportConfig},
    "trainer": {"schema": TrainerConfig},
    "wrap": {"schema_none": NoWrapConfig, "schema_prune": PruneConfig},
    "strategy": {
        "schema_default": DefaultStrategyConfig,
        "schema_mirrored": MirroredStrategyConfig,
        "schema_multiworker": MultiWorkerStrategyConfig,
    },
}


def register() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    for group, entries in SCHEMAS.items():
        for name, node in entries.items():
            store.store(group=group, name=name, node=node)


register()


def check_values(cfg: Any) -> None:
    """Values the schemas' types let through but no run can use, refused before anything
    is built or written (``ConfigError``: exit 2, naming the key). Composing already
    checked the types of the schema keys; ``resume`` and ``resume_dir`` have none."""
    trainer = cfg.get("trainer") or {}
    for key, least in (("epochs", 1), ("batch_size", 1), ("steps_per_epoch", 1)):
        value = trainer.get(key)
        if value is None and key == "steps_per_epoch":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            none = " or null (the whole split)" if key == "steps_per_epoch" else ""
            raise ConfigError(
                f"trainer.{key} must be a whole number of at least {least}{none}. "
                f"Received: {value!r}"
            )
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(
            f"seed must be a whole number from 0 to 2**32-1 (NumPy's and Keras's seed range). "
            f"Received: seed={seed!r}"
        )
    optimizer = cfg.get("optimizer") or {}
    rate = optimizer.get("learning_rate") if hasattr(optimizer, "get") else None
    if isinstance(rate, bool | str) or (isinstance(rate, int | float) and not rate > 0):
        raise ConfigError(
            f"optimizer.learning_rate must be a number above 0 (a rate of 0 or below does "
            f"not descend) or a schedule's config. Received: optimizer.learning_rate={rate!r}"
        )
    resume, resume_dir = cfg.get("resume"), cfg.get("resume_dir")
    for key, value in (("resume", resume), ("resume_dir", resume_dir)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{key} must be a string: 'latest', 'auto' or a path (resume), a run directory "
                f"(resume_dir). Received: {value!r} ({type(value).__name__})"
            )
    check_locations(cfg)
    if resume_dir and not resume:
        raise ConfigError(
            f"resume_dir is set but resume is not, so nothing would be resumed and a new run "
            f"would start. Add resume=latest (or resume=auto), or drop resume_dir. "
            f"Received: resume_dir={resume_dir!r}, resume={resume!r}"
        )


def check_locations(cfg: Any) -> None:
    """The run's locations are local paths or s3:// URLs: ``run_dir``, ``resume``,
    ``resume_dir`` (``training.remote_run``), ``export.directory`` and
    ``trainer.tensorboard_dir`` (``training.store_sync``); ``checkpoint.directory``, a
    name inside the run directory or a URL (``training.remote_run``). Any other URL is
    refused before anything is written, never taken for a local folder named ``s3:``."""
    resume = cfg.get("resume")
    keys = {"run_dir": cfg.get("run_dir"), "resume_dir": cfg.get("resume_dir")}
    if resume not in (None, "latest", "auto"):
        keys["resume"] = resume
    for section, key in (("checkpoint", "directory"), ("export", "directory")):
        group = cfg.get(section)
        if hasattr(group, "get"):
            keys[f"{section}.{key}"] = group.get(key)
    trainer = cfg.get("trainer")
    if hasattr(trainer, "get"):
        keys["trainer.tensorboard_dir"] = trainer.get("tensorboard_dir")
    for key, value in keys.items():
        if is_remote(value):
            Store(value)  # a supported scheme, the extra installed: checked now
        elif isinstance(value, str):
            local_path(value, key)
