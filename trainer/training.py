"""``train(cfg)``: build everything from the Hydra config, fit, checkpoint, return metrics."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import hydra
import keras
import tensorflow as tf
from omegaconf import DictConfig, OmegaConf

import trainer.config  # noqa: F401  (registers the schemas conf/ extends, before Hydra composes)
from trainer import distribute, resume, user_callbacks
from trainer.callbacks import RunProgbar, RunProgress, ScalarLogger
from trainer.checkpointing import Checkpoint, CheckpointManager, CheckpointPolicy
from trainer.data import DataSplits, eval_dataset, run_dataset, steps_per_epoch
from trainer.export import export_for_run
from trainer.save_backends import load_checkpoint
from trainer.state import TrainingState
from trainer.tensorboard import RunBoard, config_hash, flatten_config
from trainer.wrapping import apply_wrap, unwrap_model

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Train the configured model and return the final validation (or training) metrics."""
    dist = distribute.setup(cfg.get("strategy"))  # before any other TensorFlow op
    try:
        return run(cfg, dist)
    finally:
        dist.cleanup()  # a non-chief worker's scratch outputs


def run(cfg: DictConfig, dist: distribute.Distribution) -> dict[str, float]:
    """``train`` under ``dist``: only the chief writes into the run directory, the other
    workers write the same things into their scratch directory (``dist.output_dir``)."""
    run_dir = resolve_run_dir(cfg)
    checkpoint_dirname = cfg.checkpoint.directory
    resume_from = resume.resolve_resume(
        cfg.get("resume"), cfg.get("resume_dir"), run_dir, checkpoint_dirname
    )
    if resume_from is not None:
        # Continue in the run that wrote the checkpoint, so its checkpoints, retention and
        # TensorBoard curves carry on in one place.
        run_dir = resume.run_dir_of(resume_from, checkpoint_dirname) or run_dir
    keras.utils.set_random_seed(int(cfg.seed))
    if cfg.trainer.deterministic:
        tf.config.experimental.enable_op_determinism()

    data: DataSplits = hydra.utils.instantiate(cfg.data)
    steps = steps_per_epoch(len(data.x_train), cfg.trainer.batch_size, cfg.trainer.steps_per_epoch)
    with dist.scope():  # model, optimizer and metrics variables are distributed
        model, wrap_callbacks = build_model(
            cfg, data, total_steps=steps * cfg.trainer.epochs, lr_factor=dist.lr_factor
        )
        build_metric_variables(model, data)
    dist.prepare_model(model, (data.x_train[:1], data.y_train[:1]))
    policy = CheckpointPolicy(**OmegaConf.to_container(cfg.checkpoint.policy, resolve=True))
    policy.check_name(model.get_metrics_result(), validation=len(data.x_val) > 0)
    state = TrainingState(seed=int(cfg.seed))
    if resume_from is not None:
        state = restore(cfg, dist, model, resume_from)

    config_record = OmegaConf.to_container(cfg, resolve=True)
    out_dir = dist.output_dir(run_dir)
    progress = RunProgress(state, steps)
    scalars = ScalarLogger(
        out_dir / cfg.trainer.tensorboard_dir, state, on_write_error=policy.on_save_error
    )
    # Created after ScalarLogger: its session-start mark must sort before the board's file.
    board = RunBoard(
        out_dir / cfg.trainer.tensorboard_dir,
        run_dir=out_dir,
        config_hash=config_hash(config_record),
        on_write_error=policy.on_save_error,
    )
    if state.global_step == 0:
        board.write_graph(model)
    manager, callbacks = wire_callbacks(
        cfg, dist, out_dir, state, policy, progress, board, [*wrap_callbacks, scalars]
    )

    val = eval_dataset(data.x_val, data.y_val, cfg.trainer.batch_size) if len(data.x_val) else None
    log.info(
        "Training %s (%d parameters) on %d examples, %d steps/epoch, %d epochs; backend %s; %s",
        model.name,
        model.count_params(),
        len(data.x_train),
        steps,
        cfg.trainer.epochs,
        manager.backend,
        dist.describe(cfg.trainer.batch_size),
    )
    try:
        with progress.stop_on_signals():
            fit_run(model, data, val, cfg, state, steps, callbacks)
            manager.wait()
    except BaseException:
        scalars.close()
        board.close()
        try:
            manager.wait()
        except Exception:  # logged in full; the error already propagating must win
            log.exception("The last checkpoint write failed")
        raise
    scalars.close()

    report(cfg, run_dir, manager, progress)
    if progress.interrupted:
        board.close()
        return dict(state.metrics)
    return evaluate_and_export(cfg, model, val, data, state, out_dir, board, config_record)


def evaluate_and_export(cfg, model, val, data, state, out_dir, board, config_record):
    """After a run that finished: final metrics, hparams, the serving export."""
    try:
        metrics = final_metrics(model, val, data, cfg.trainer.batch_size)
        log.info("Final metrics: %s", ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        board.write_hparams(flatten_config(config_record), metrics, step=state.global_step)
        export_cfg = cfg.get("export")
        exported = export_for_run(
            unwrap_model(model) if export_cfg and export_cfg.get("unwrap") else model,
            out_dir,
            export_cfg,
            board=board,
            state=state,
            validation_x=data.x_val,
            config=config_record,
        )
        if exported is not None:
            log.info("Export:        %s", exported)
        return metrics
    finally:
        board.close()


def wire_callbacks(cfg, dist, out_dir, state, policy, progress, board, middle):
    """The checkpoint manager and the run's callbacks, in the order they must run: stop
    agreement (multi-worker), step counting, the configured ones, ``middle`` (wrappers'
    callbacks: masks baked in before epoch-end saves; TensorBoard scalars), checkpointing,
    the epoch cutter; the progress bar right after the configured ones."""
    manager = CheckpointManager(
        out_dir / cfg.checkpoint.directory,
        dist.backend(hydra.utils.instantiate(cfg.save)),
        policy,
        metadata={"config": OmegaConf.to_container(cfg, resolve=True)},
        board=board,
    )
    manager.adopt(state)  # retention continues from the resumed checkpoint's records
    configured = user_callbacks.ConfigCallbacks(
        user_callbacks.build(cfg.get("callbacks"), out_dir), state, saved=state.callbacks
    )
    checkpoint = Checkpoint(
        manager=manager, state=state, progress=progress, callback_state=configured.state_dict
    )
    callbacks = [
        *dist.callbacks(progress),  # multi-worker: agree on stop signals first
        progress,
        configured,
        # The bar ends each epoch's line before anything after it logs (saves included).
        *([RunProgbar(state)] if cfg.trainer.verbose else []),
        *middle,
        checkpoint,
        progress.epoch_cutter(),  # after every other callback
    ]
    return manager, callbacks


def restore(cfg: DictConfig, dist, model: keras.Model, path: Path) -> TrainingState:
    """Put the checkpoint at ``path`` into ``model`` after checking it fits the config."""
    loaded = load_checkpoint(path)
    resume.check_compatible(cfg, loaded.metadata, path)
    with dist.scope():  # may build the optimizer: its variables are distributed too
        state = resume.restore_into(model, loaded)
    log.info(
        "Resuming from %s at epoch %d, step %d (+%d in epoch)",
        path,
        state.epoch,
        state.global_step,
        state.step_in_epoch,
    )
    return state


def report(cfg: DictConfig, run_dir: Path, manager: CheckpointManager, progress) -> None:
    """Where everything went; after an interrupt, the command that resumes."""
    state = progress.state
    log.info("Run directory: %s", run_dir)
    kept = [p.name for p in manager.saved if p.exists()]  # retention removed the rest
    if kept:
        log.info("Checkpoints:   %s: %s (latest)", manager.directory, ", ".join(kept))
    else:
        log.info("Checkpoints:   none")
    log.info("TensorBoard:   tensorboard --logdir %s", run_dir / cfg.trainer.tensorboard_dir)
    if progress.interrupted:
        where = manager.saved[-1] if manager.saved else None
        log.warning(
            "Interrupted at epoch %d, step %d. %s",
            state.epoch,
            state.global_step,
            f"Saved {where}; resume with: {resume.resume_hint(where, cfg.checkpoint.directory)}"
            if where
            else "No checkpoint was saved (checkpoint.policy.on_interrupt=false).",
        )


def fit_run(model, data, val, cfg, state, steps, callbacks) -> None:
    """One ``fit`` from where ``state`` stands to the last epoch, over every epoch's seeded
    order (a resumed epoch without its consumed batches; ``RunProgress`` ends it)."""
    if state.epoch >= cfg.trainer.epochs:
        return
    if state.stopped_early:
        log.info("A callback ended this run at epoch %d; nothing left to train", state.epoch)
        return
    batches = run_dataset(
        data.x_train,
        data.y_train,
        batch_size=cfg.trainer.batch_size,
        seed=int(cfg.seed),
        epochs=cfg.trainer.epochs,
        first_epoch=state.epoch,
        skip_batches=state.step_in_epoch,
        max_batches=steps,
    )
    model.fit(
        batches,
        epochs=cfg.trainer.epochs,
        initial_epoch=state.epoch,
        steps_per_epoch=steps,
        validation_data=val,
        callbacks=callbacks,
        verbose=cfg.trainer.verbose,
        shuffle=False,  # the order is already the seeded per-epoch permutation
    )


def resolve_run_dir(cfg: DictConfig) -> Path:
    """Hydra's output directory when run under Hydra, else ``cfg.run_dir`` or the cwd."""
    explicit = cfg.get("run_dir")
    if explicit:
        path = Path(explicit)
    elif hydra.core.hydra_config.HydraConfig.initialized():
        path = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    else:
        path = Path(os.getcwd())
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_model(
    cfg: DictConfig, data: DataSplits, *, total_steps: int, lr_factor: float = 1.0
) -> tuple[keras.Model, list[keras.callbacks.Callback]]:
    """The configured model, wrapped per ``cfg.wrap`` and compiled; plus the wrapper's
    training callbacks (e.g. the pruning schedule). ``lr_factor``: see trainer.distribute."""
    model = hydra.utils.instantiate(
        cfg.model, input_shape=list(data.input_shape), num_classes=data.num_classes
    )
    model, wrap_callbacks = apply_wrap(model, cfg.get("wrap"), total_steps=total_steps)
    model.compile(
        optimizer=build_optimizer(
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


def build_optimizer(
    optimizer_cfg: DictConfig, schedule_cfg: DictConfig | None, total_steps: int
) -> keras.optimizers.Optimizer:
    """The optimizer, with ``learning_rate`` turned into a schedule when one is selected."""
    if schedule_cfg is None or schedule_cfg.get("_target_") is None:
        return hydra.utils.instantiate(optimizer_cfg)
    options: dict[str, Any] = OmegaConf.to_container(schedule_cfg, resolve=True)
    if "decay_steps" in options and options["decay_steps"] is None:
        options["decay_steps"] = max(1, total_steps)
    schedule = hydra.utils.instantiate(
        options, initial_learning_rate=float(optimizer_cfg.learning_rate)
    )
    return hydra.utils.instantiate(optimizer_cfg, learning_rate=schedule)


def final_metrics(
    model: keras.Model, val: tf.data.Dataset | None, data: DataSplits, batch_size: int
) -> dict[str, float]:
    if val is not None:
        results = model.evaluate(val, verbose=0, return_dict=True)
        return {f"val_{k}": float(v) for k, v in results.items()}
    results = model.evaluate(
        eval_dataset(data.x_train, data.y_train, batch_size), verbose=0, return_dict=True
    )
    return {k: float(v) for k, v in results.items()}
