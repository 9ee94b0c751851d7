"""The end of a run: final metrics, hparams, the serving export; signals while they run.

Why a module of its own: these steps run after the last training step, where the
checkpoint that makes the run resumable is already on disk. They must be repeatable: a
finished run that is resumed (re-running the command of a preempted job, or one interrupted
during its export) runs exactly the steps that are missing, and a SIGTERM/SIGINT during
them ends the process cleanly (exit 0) instead of killing it with a half-written export.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer.checkpointing.policy import scalar_metrics
from trainer.data import DataSplits, eval_dataset
from trainer.errors import TrainerError
from trainer.exports.exporter import DEFAULT_KEEP, export_tag, read_export_metadata, versions
from trainer.exports.sources import export_for_run
from trainer.state import TrainingState
from trainer.tensorboard.board import RunBoard, flatten_config
from trainer.tensorboard.links import LogView
from trainer.training import interrupts, store_sync
from trainer.wrapping import unwrap_model

log = logging.getLogger(__name__)

FINAL_PREFIX = "final/"  # RunBoard.write_hparams: the final metrics' scalar tags


class RunInterrupted(BaseException):
    """SIGTERM/SIGINT outside the training loop. A ``BaseException`` (like
    ``KeyboardInterrupt``) so no ``except Exception`` on the way swallows it, and the
    export's own ``except BaseException`` removes its temporary directory."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


def signals_raise() -> interrupts.Phase:
    """The phase of a run's set-up and end (``with signals_raise():``): SIGTERM/SIGINT
    raise ``RunInterrupted`` in the main thread. The training loop enters its own phase
    inside (stop after the current batch); this covers the set-up before it and the
    end-of-run steps after it, where the default SIGTERM action would kill the process
    mid-write."""

    def interrupt(signum, _frame):
        phase.ignore()  # a second signal while unwinding must not interrupt the cleanup
        interrupts.record(signum)  # a multirun stops its sweep after this job
        raise RunInterrupted(signum)

    phase = interrupts.Phase("run set-up and end", interrupt)
    return phase


def finish_run(
    cfg,
    model: keras.Model,
    val: tf.data.Dataset | None,
    data: DataSplits,
    state: TrainingState,
    out_dir: Path,
    board: RunBoard,
    config_record: dict[str, Any],
    *,
    resumed_finished: bool,
    to_store: bool = True,
) -> dict[str, float]:
    """Final metrics, hparams and the serving export of a run whose training is complete.
    ``resumed_finished``: the run was complete before this session, so hparams and the
    export are written only if an earlier session did not get to them. ``to_store``: a
    run on object storage publishes its export there (only its chief does)."""
    metrics = final_metrics(model, val, data, cfg.trainer.batch_size)
    log.info("Final metrics: %s", ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    tb_dir = out_dir / store_sync.tensorboard_location(cfg)[0]
    if resumed_finished and has_final_metrics(tb_dir, state.global_step):
        log.info("HParams:       already written at step %d", state.global_step)
    else:
        board.write_final_metrics(metrics, step=state.global_step)
    # A session that trains wrote its hparams when it started (training.build_run). One
    # that resumes a finished run keeps the config that trained it (a lower trainer.epochs
    # would misreport it), only finishing a replacement a crash interrupted; it writes its
    # own only when the run has none (an older version wrote them at the end).
    if resumed_finished and not board.replace_earlier_hparams():
        board.write_session_hparams(flatten_config(config_record))
    export_cfg = store_sync.export_options(cfg)  # the local directory: the URL's staging
    export_url = store_sync.export_location(cfg)[1] if to_store else None
    existing = export_of_step(out_dir, export_cfg, state) if resumed_finished else None
    if existing is not None:
        log.info("Export:        %s (already written at step %d)", existing, state.global_step)
        if export_url is not None:  # stopped before its upload
            publish_on_store(export_url, export_cfg, existing, state, board, unless_there=True)
        return metrics
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
        if export_url is not None:
            publish_on_store(export_url, export_cfg, exported, state, board, unless_there=False)
    return metrics


def publish_on_store(
    export_url: str, options, version_dir: Path, state, board: RunBoard, *, unless_there: bool
) -> None:
    """Publish the complete local export ``version_dir`` at ``export_url``
    (``store_sync.publish_export``) and note the version's URL on its TensorBoard card.
    ``unless_there``: not if the store already has a version of this step (an earlier
    session's export found again locally)."""
    url = store_sync.publish_export(
        export_url,
        version_dir,
        step=int(state.global_step),
        keep=int(options.get("keep") or DEFAULT_KEEP),
        unless_step_there=unless_there,
    )
    if url is not None:
        log.info("Export:        %s (on the store)", url)
        board.artifact_published(int(state.global_step), export_tag(board, version_dir), url)


def has_final_metrics(tb_dir: Path, step: int) -> bool:
    """Whether an event file under ``tb_dir`` holds the final metrics at ``step`` that
    TensorBoard shows: not those of a branch a later session's restart hid (a resume from
    an older checkpoint that then reached the same step)."""
    for log_dir in sorted({path.parent for path in Path(tb_dir).rglob("events.out.tfevents*")}):
        view = LogView.read(log_dir)
        for name in view.steps:
            final = [t for t in view.tags(log_dir / name, step) if t.startswith(FINAL_PREFIX)]
            if final and view.shows(log_dir / name, step, final[0]):
                return True
    return False


def export_of_step(
    out_dir: Path, export_cfg: Mapping[str, Any] | None, state: TrainingState
) -> Path | None:
    """The run's complete export of the model ``state`` describes, if one exists (None when
    exports are off: then nothing is missing either, and the caller's export call returns
    None). The same step is not enough: a branch resumed from an older checkpoint reaches
    the steps of the one it abandoned, whose export is another model; the export's
    recorded history of epochs must be this state's."""
    options = dict(export_cfg or {})
    if not options.get("enabled", True):
        return None
    root = Path(out_dir) / str(options.get("directory") or "export")
    for version in reversed(versions(root)):
        try:
            meta = read_export_metadata(root / str(version))
        except TrainerError:
            continue
        recorded = meta.get("state") or {}
        if int(recorded.get("global_step", -1)) == int(state.global_step) and recorded.get(
            "history"
        ) == json.loads(json.dumps(state.history)):
            return root / str(version)
    return None


def final_metrics(
    model: keras.Model, val: tf.data.Dataset | None, data: DataSplits, batch_size: int
) -> dict[str, float]:
    """The model's metrics on the validation split (the training split if there is none)."""
    if val is not None:
        results = model.evaluate(val, verbose=0, return_dict=True)
        return {f"val_{k}": v for k, v in scalar_metrics(results).items()}
    results = model.evaluate(
        eval_dataset(data.x_train, data.y_train, batch_size), verbose=0, return_dict=True
    )
    return scalar_metrics(results)
