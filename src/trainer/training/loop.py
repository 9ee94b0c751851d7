"""``train(cfg)``: build everything from the Hydra config, fit, checkpoint, return metrics."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf
from omegaconf import DictConfig, OmegaConf

import trainer.training.config  # registers the schemas conf/ extends, before Hydra composes
from trainer.checkpointing import Checkpoint, CheckpointManager, CheckpointPolicy
from trainer.data import DataSplits, eval_dataset, steps_per_epoch
from trainer.errors import ConfigError, DirectoryInUseError
from trainer.exports import sources
from trainer.runs import sessions
from trainer.state import TrainingState
from trainer.tensorboard.board import RunBoard, config_hash, flatten_config, tensorboard_command
from trainer.training import (
    distribute,
    remote_run,
    resume,
    run_end,
    store_sync,
    user_callbacks,
)
from trainer.training.building import build_metric_variables, build_model
from trainer.training.fitting import fit_run
from trainer.training.instantiation import instantiate
from trainer.training.progress import RunProgbar, RunProgress, ScalarLogger
from trainer.training.session_io import (
    build_backend,
    configured_backend,
    resolve_run_dir,
    restore,
)

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Train the configured model: what ``python train.py`` runs, callable from Python.

    Builds the model, data, optimizer, schedule and save backend from ``cfg``, resumes if
    asked, fits with checkpointing and TensorBoard, and writes the final metrics and the
    serving export. SIGTERM/SIGINT end it cleanly at any point (``run_end.signals_raise``),
    from the strategy's set-up on: building a multi-worker strategy can wait for its peers.
    Code that composes ``conf/`` itself imports ``trainer.training.config`` first.

    Args:
        cfg: The composed config of ``conf/config.yaml`` (``hydra.compose`` or Hydra's
            ``@hydra.main``); ``run_dir`` set, or a Hydra run directory.

    Returns:
        The final validation (or training) metrics; after an interrupt, the last completed
        epoch's (empty in the first epoch).

    Raises:
        ConfigError: A value no run can use (``trainer.epochs=0``, a ``_target_`` that cannot
            be imported or built, a URL for a path, ``resume_dir`` without ``resume``...),
            before anything is written; ``DataError`` for NaN or out-of-range data.
        ConfigMismatchError: A resume whose config changes the model, optimizer, schedule,
            wrapping, or (unless ``resume_allow_inexact``) the data order.
        NotACheckpointError: ``resume=latest`` with no checkpoint to resume.
        CorruptCheckpointError: Every checkpoint to resume from is damaged.
        DirectoryInUseError: Another process is writing to the run directory.
        TrainingDivergedError: The loss became NaN or infinite.
        SaveError: A checkpoint or TensorBoard write failed (with
            ``checkpoint.policy.on_save_error=raise``).
        ExportError: The serving export could not be written.
    """
    dist: distribute.Distribution | None = None
    try:
        with run_end.signals_raise():
            try:
                dist = distribute.setup(cfg.get("strategy"))  # before any other TensorFlow op
                return run(cfg, dist)
            except run_end.RunInterrupted as interrupt:
                log.warning(
                    "Received %s before training started; nothing was trained in this "
                    "session. Re-run the same command to start (with resume=auto: to "
                    "continue) the run.",
                    interrupt.signal_name,
                )
                return {}
    finally:
        if dist is not None:
            dist.cleanup()  # a non-chief worker's scratch outputs


@dataclasses.dataclass
class RunParts:
    """Everything ``build_run`` sets up for one session of a run."""

    run_dir: Path
    out_dir: Path
    data: DataSplits
    val: tf.data.Dataset | None
    steps: int
    model: keras.Model
    state: TrainingState
    progress: RunProgress
    scalars: ScalarLogger
    board: RunBoard
    manager: CheckpointManager
    callbacks: list[keras.callbacks.Callback]
    config_record: dict[str, Any]
    finished_before: bool  # the resumed checkpoint had every epoch trained already


def run(cfg: DictConfig, dist: distribute.Distribution) -> dict[str, float]:
    """``train`` under ``dist`` (inside ``train``'s ``signals_raise``): only the chief
    writes into the run directory, the other workers write the same things into their
    scratch directory (``dist.output_dir``). A signal during ``fit`` stops after the current
    batch (with an interrupt checkpoint), before or after it at once."""
    trainer.training.config.check_values(cfg)  # before anything is built or written
    run_dir, resume_from, source = locate_run(cfg, dist)
    if dist.is_chief:  # the one that uploads: a missing bucket is refused before training
        store_sync.check_buckets(cfg)
    try:
        out_dir = dist.output_dir(run_dir)  # the chief locks the run directory
    except DirectoryInUseError:
        sessions.restore_hydra_files(run_dir)  # Hydra rewrote them before the lock
        raise
    # This session's log and Hydra config go to the run it continues (sessions.py).
    with sessions.session(out_dir, source):
        tb_local, tb_url = store_sync.tensorboard_location(cfg)
        if tb_url is None or not dist.is_chief:  # only the chief uploads
            return run_session(cfg, dist, run_dir, resume_from)
        events = store_sync.EventSync(tb_url, out_dir / tb_local)
        try:
            metrics = run_session(cfg, dist, run_dir, resume_from, events)
        except BaseException:
            events.final(failing=True)  # a preempted or failed run's curves, up to its end
            raise
        events.final(failing=False)
        return metrics


def run_session(
    cfg, dist, run_dir: Path, resume_from: Path | None, events=None
) -> dict[str, float]:
    """Build, fit and finish one session (under ``train``'s ``signals_raise``): a signal
    after the build ends it cleanly. ``events``: on a store, what uploads the TensorBoard
    log after each checkpoint upload (``store_sync.EventSync``)."""
    parts = build_run(cfg, dist, run_dir, resume_from)
    if events is not None:
        parts.manager.after_publish.append(events)
    try:
        fit_session(cfg, dist, parts)
        report(cfg, parts.run_dir, parts.manager, parts.progress)
        if parts.progress.interrupted:
            parts.board.close()
            return dict(parts.state.metrics)
        if parts.progress.requested_signal is not None:  # after the last step's save
            raise run_end.RunInterrupted(parts.progress.requested_signal)
        try:
            return run_end.finish_run(
                cfg,
                parts.model,
                parts.val,
                parts.data,
                parts.state,
                parts.out_dir,
                parts.board,
                parts.config_record,
                resumed_finished=parts.finished_before,
                to_store=dist.is_chief,
            )
        finally:
            parts.board.close()
    except run_end.RunInterrupted as interrupt:
        parts.scalars.close()  # both close again harmlessly if already closed
        parts.board.close()
        report_end_interrupted(cfg, parts, interrupt)
        return dict(parts.state.metrics)
    finally:
        parts.manager.release()  # on a store: the next writer need not wait for the expiry


def locate_run(cfg: DictConfig, dist=None) -> tuple[Path, Path | None, str | Path | None]:
    """The run directory of this session, the checkpoint it resumes from (or None) and
    where that checkpoint came from, as the session records it: a checkpoint's URL for a
    local copy of a store's. A run on object storage: its local mirror, and a local copy of
    the store's checkpoint (under ``strategy=multiworker``: the one the chief chose, on
    every worker); a run on disk with ``checkpoint.directory=s3://...``: the same, in its
    own run directory."""
    if remote_run.is_remote_run(cfg):
        return remote_run.locate(cfg, dist)
    if remote_run.checkpoints_on_store(cfg):
        remote_run.check(cfg)  # before the run directory is created
        return remote_run.locate(cfg, dist, resolve_run_dir(cfg))
    run_dir = resolve_run_dir(cfg)
    checkpoint_dirname = cfg.checkpoint.directory
    if remote_run.resumes_from_store(cfg):
        return run_dir, *remote_run.resume_from_store(cfg, run_dir, configured_backend(cfg))
    resume_from = resume.resolve_resume(
        cfg.get("resume"),
        cfg.get("resume_dir"),
        run_dir,
        checkpoint_dirname,
        configured_backend(cfg) if cfg.get("resume") else None,
    )
    if resume_from is not None:
        # Continue in the run that wrote the checkpoint, so its checkpoints, retention and
        # TensorBoard curves carry on in one place.
        run_dir = resume.run_dir_of(resume_from, checkpoint_dirname) or run_dir
    else:
        try:
            resume.refuse_fresh_over(run_dir, checkpoint_dirname, configured_backend(cfg))
        except ConfigError:
            sessions.restore_hydra_files(run_dir)  # Hydra rewrote them before this check
            raise
    return run_dir, resume_from, resume_from


def build_run(
    cfg: DictConfig, dist: distribute.Distribution, run_dir: Path, resume_from: Path | None
) -> RunParts:
    """Build the data, model, state, TensorBoard writers, checkpoint manager and callbacks
    of this session of the run in ``run_dir``, resumed from ``resume_from`` if set."""
    keras.utils.set_random_seed(int(cfg.seed))
    if cfg.trainer.deterministic:
        tf.config.experimental.enable_op_determinism()

    data: DataSplits = instantiate(cfg.data, "data")
    steps = steps_per_epoch(len(data.x_train), cfg.trainer.batch_size, cfg.trainer.steps_per_epoch)
    with dist.scope():  # model, optimizer and metrics variables are distributed
        model, wrap_callbacks = build_model(
            cfg, data, total_steps=steps * cfg.trainer.epochs, lr_factor=dist.lr_factor
        )
        build_metric_variables(model, data)
    dist.prepare_model(model, (data.x_train[:1], data.y_train[:1]))
    policy = CheckpointPolicy(**OmegaConf.to_container(cfg.checkpoint.policy, resolve=True))
    policy.check_name(model.get_metrics_result(), validation=len(data.x_val) > 0)
    sources.check_export_options(  # not only once trained
        store_sync.export_options(cfg), checkpoint_directory=cfg.checkpoint.directory
    )
    state = TrainingState(seed=int(cfg.seed))
    if resume_from is not None:
        state = restore(cfg, dist, model, resume_from)

    out_dir = dist.output_dir(run_dir)
    # The user's callbacks before anything of the session is written (TensorBoard's session
    # mark and graph included): a run they refuse leaves nothing that looks like a run.
    configured = user_callbacks.ConfigCallbacks(
        user_callbacks.build(cfg.get("callbacks"), out_dir), state, saved=state.callbacks
    )
    user_callbacks.check_rate_setters(configured.named, model)
    config_record = OmegaConf.to_container(cfg, resolve=True)
    progress = RunProgress(state, steps)
    tb_local, tb_url = store_sync.tensorboard_location(cfg)
    scalars = ScalarLogger(out_dir / tb_local, state, on_write_error=policy.on_save_error)
    # Created after ScalarLogger: its session-start mark must sort before the board's file.
    board = RunBoard(
        out_dir / tb_local,
        run_dir=out_dir,
        config_hash=config_hash(config_record),
        on_write_error=policy.on_save_error,
        log_url=tb_url if dist.is_chief else None,
    )
    if state.global_step == 0:
        board.write_graph(model)
    finished = state.epoch >= cfg.trainer.epochs or state.stopped_early
    manager, callbacks = wire_callbacks(
        cfg, dist, out_dir, state, policy, progress, board, configured, [*wrap_callbacks, scalars]
    )
    if not finished:  # this session trains (nothing refused it): its config is the run's
        board.write_session_hparams(flatten_config(config_record))
    val = eval_dataset(data.x_val, data.y_val, cfg.trainer.batch_size) if len(data.x_val) else None
    return RunParts(
        run_dir, out_dir, data, val, steps, model, state, progress, scalars, board, manager,
        callbacks, config_record, finished_before=resume_from is not None and finished,
    )  # fmt: skip


def fit_session(cfg: DictConfig, dist: distribute.Distribution, parts: RunParts) -> None:
    """This session's ``fit`` (nothing when every epoch is trained already), under the
    loop's signal handling, then every checkpoint write on disk."""
    model, manager = parts.model, parts.manager
    log.info(
        "Training %s (%d parameters) on %d examples, %d steps/epoch, %d epochs; backend %s; %s",
        model.name,
        model.count_params(),
        len(parts.data.x_train),
        parts.steps,
        cfg.trainer.epochs,
        manager.backend,
        dist.describe(cfg.trainer.batch_size),
    )
    try:
        with parts.progress.stop_on_signals(), dist.stop_agreement():
            fit_run(model, parts.data, parts.val, cfg, parts.state, parts.steps, parts.callbacks)
            manager.wait()
    except BaseException:
        parts.scalars.close()
        parts.board.close()
        try:
            manager.wait()
        except Exception:  # logged in full; the error already propagating must win
            log.exception("The last checkpoint write failed")
        raise
    parts.scalars.close()


def wire_callbacks(cfg, dist, out_dir, state, policy, progress, board, configured, middle):
    """The checkpoint manager and the run's callbacks, in the order they must run: stop
    agreement (multi-worker), step counting, the configured ones (``configured``, built and
    checked by ``build_run``), ``middle`` (wrappers' callbacks: masks baked in before
    epoch-end saves; TensorBoard scalars), checkpointing, the epoch cutter; the progress
    bar right after the configured ones."""
    local = out_dir / remote_run.local_checkpoint_name(cfg)
    # Only the chief writes to the store (and holds its lease); another worker's saves go
    # to its scratch directory and are removed at once (``dist.backend``). A run on a store
    # stages in its mirror; a run on disk with checkpoint.directory=s3://... in trainer's
    # staging cache (one folder per URL), so its run directory holds no second copy.
    on_store = remote_run.checkpoints_on_store(cfg) and dist.is_chief
    staging = local if remote_run.is_remote_run(cfg) else None
    manager = CheckpointManager(
        remote_run.checkpoint_url(cfg) if on_store else local,
        dist.backend(build_backend(cfg)),
        policy,
        metadata={"config": OmegaConf.to_container(cfg, resolve=True)},
        board=board,
        staging=staging if on_store else None,  # staged locally, then uploaded
    )
    manager.claim()  # on a store: a second writer is refused now, before it trains
    manager.adopt(state)  # retention continues from the resumed checkpoint's records
    if state.global_step:  # resumed: what came after its checkpoint is another branch
        manager.set_aside_after(state.global_step)
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


def report(cfg: DictConfig, run_dir: Path, manager: CheckpointManager, progress) -> None:
    """Where everything went; after an interrupt, the command that resumes."""
    state = progress.state
    if remote_run.is_remote_run(cfg):
        log.info("Run directory: %s (local files: %s)", cfg.run_dir, run_dir)
    else:
        log.info("Run directory: %s", run_dir)
    kept = [os.path.basename(p) for p in manager.all()]  # now: retention removed the rest
    if kept:
        where = manager.remote.url if manager.remote is not None else manager.directory
        log.info("Checkpoints:   %s: %s (latest)", where, ", ".join(kept))
    else:
        log.info("Checkpoints:   none")
    tb_local, tb_url = store_sync.tensorboard_location(cfg)
    name = os.path.relpath(run_dir / tb_local, run_dir.parent)
    log.info("TensorBoard:   %s  (this run: %s)", tensorboard_command(run_dir), name)
    if tb_url is not None:
        log.info("TensorBoard:   copied to %s", tb_url)
    if progress.interrupted:
        where = manager.saved[-1] if manager.saved else None
        # Epochs as the progress bar numbers them (from 1): "Epoch 1/2" was reported as
        # "Interrupted at epoch 0" (the count of completed epochs).
        log.warning(
            "Interrupted %s, step %d. %s",
            f"in epoch {state.epoch + 1}, after {state.step_in_epoch} of its batches"
            if state.step_in_epoch
            else f"after epoch {state.epoch}",
            state.global_step,
            f"Saved {where}; resume with: {hint(cfg, run_dir, where)}"
            if where
            else "No checkpoint was saved (checkpoint.policy.on_interrupt=false).",
        )


def report_end_interrupted(cfg: DictConfig, parts: RunParts, interrupt: BaseException) -> None:
    """A signal outside ``fit``'s batches (between the last step and the end of the serving
    export): what is done, and the command that finishes the rest."""
    latest = parts.manager.latest()
    state = parts.state
    log.warning(
        "Received %s at epoch %d, step %d, outside the training loop; stopped before the "
        "end-of-run steps (final metrics, hparams, serving export) completed. %s",
        getattr(interrupt, "signal_name", interrupt),
        state.epoch,
        state.global_step,
        f"The newest checkpoint is {latest}; re-run with: {hint(cfg, parts.run_dir, latest)}"
        if latest is not None
        else "No checkpoint was saved in this run.",
    )


def hint(cfg: DictConfig, run_dir: Path, checkpoint: Path) -> str:
    """The command that resumes from ``checkpoint`` with this session's own overrides."""
    if remote_run.checkpoints_on_store(cfg):
        return remote_run.resume_command(cfg, resume.run_overrides(run_dir), run_dir)
    return resume.resume_hint(checkpoint, cfg.checkpoint.directory, resume.run_overrides(run_dir))
