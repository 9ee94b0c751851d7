"""The configured model, compiled with the configured optimizer and schedule, as ``train``
builds it (also what a test or a script builds to get the same model without training)."""

from __future__ import annotations

from typing import Any

import keras
from omegaconf import DictConfig, OmegaConf

from trainer.data import DataSplits
from trainer.training import distribute
from trainer.training.instantiation import instantiate
from trainer.wrapping import apply_wrap


def build_model(
    cfg: DictConfig, data: DataSplits, *, total_steps: int, lr_factor: float = 1.0
) -> tuple[keras.Model, list[keras.callbacks.Callback]]:
    """The configured model, wrapped per ``cfg.wrap`` and compiled; plus the wrapper's
    training callbacks (e.g. the pruning schedule). ``lr_factor``: see
    ``trainer.training.distribute``."""
    model = instantiate(
        cfg.model, "model", input_shape=list(data.input_shape), num_classes=data.num_classes
    )
    model, wrap_callbacks = apply_wrap(model, cfg.get("wrap"), total_steps=total_steps)
    model.compile(
        optimizer=configured_optimizer(
            distribute.scaled_optimizer_cfg(cfg.optimizer, lr_factor),
            cfg.get("schedule"),
            total_steps,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model, wrap_callbacks


def build_metric_variables(model: keras.Model, data: DataSplits) -> None:
    """Create the compiled metrics' accumulators now rather than in the first train step,
    so a mid-epoch resume can put back their sums before that step runs. Inference on one
    example changes no state (no dropout draw, no BatchNorm update)."""
    x, y = data.x_train[:1], data.y_train[:1]
    model.compute_metrics(x, y, model(x, training=False))
    model.reset_metrics()


def configured_optimizer(
    optimizer_cfg: DictConfig, schedule_cfg: DictConfig | None, total_steps: int
) -> keras.optimizers.Optimizer:
    """The optimizer, with ``learning_rate`` turned into a schedule when one is selected."""
    if schedule_cfg is None or schedule_cfg.get("_target_") is None:
        return instantiate(optimizer_cfg, "optimizer")
    options: dict[str, Any] = OmegaConf.to_container(schedule_cfg, resolve=True)
    if "decay_steps" in options and options["decay_steps"] is None:
        options["decay_steps"] = max(1, total_steps)
    schedule = instantiate(
        options, "schedule", initial_learning_rate=float(optimizer_cfg.learning_rate)
    )
    return instantiate(optimizer_cfg, "optimizer", learning_rate=schedule)
