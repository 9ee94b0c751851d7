"""The checkpoint callback: when to save, what to keep, the ``latest`` pointer, async writes.

Async saving snapshots every variable synchronously into a *shadow model* (same
architecture, built once) and lets a background thread write the shadow through the
backend while training goes on. That works for every backend unchanged (they only ever
see a quiet model) and costs one memory copy per save; at most one write is in flight.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import string
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainer._compat.keras import get_input_signature
from trainer.atomic import clean_stale_temporaries, remove_path, temporary_sibling
from trainer.errors import ConfigError, SaveError
from trainer.save_backends import layerstate, modelstate
from trainer.save_backends.base import SaveBackend
from trainer.state import TrainingState
from trainer.tensorboard import LINK_KEY, RunBoard, card_tag, path_size

log = logging.getLogger(__name__)

LATEST = "latest"


@dataclasses.dataclass
class CheckpointPolicy:
    """When to save and what to keep (``conf/checkpoint``)."""

    every_n_epochs: int | None = 1
    every_n_steps: int | None = None
    on_train_end: bool = True
    on_interrupt: bool = True
    keep_last: int | None = 3
    keep_best: int = 1
    monitor: str = "val_loss"
    mode: str = "min"
    keep_every_n_epochs: int | None = None
    name: str = "step-{step:08d}"
    async_save: bool | None = None  # None: the backend's own default
    on_save_error: str = "raise"  # "continue": log a failed save and keep training

    def __post_init__(self):
        if self.on_save_error not in ("raise", "continue"):
            raise ConfigError(
                f"checkpoint.on_save_error must be 'raise' (stop training) or 'continue' "
                f"(log it and keep training). Received: {self.on_save_error!r}"
            )
        if self.mode not in ("min", "max"):
            raise ConfigError(
                f"checkpoint.mode must be 'min' or 'max' (how checkpoint.monitor improves). "
                f"Received: {self.mode!r}"
            )
        for field in ("every_n_epochs", "every_n_steps", "keep_last", "keep_every_n_epochs"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(
                    f"checkpoint.{field} must be a positive integer or null. Received: {value!r}"
                )
        name_fields(self.name)  # a malformed pattern fails here

    def check_name(self, metrics: Iterable[str], *, validation: bool) -> None:
        """Refuse, before training, a ``name`` pattern that some save could not fill.

        ``metrics`` are the names the model logs at every batch (``loss``, ``accuracy``);
        ``val_*`` ones exist only at epoch ends, and only with validation data. Step and
        interrupt saves can fall mid-epoch, before validation.
        """
        known = set(metrics)
        fields = name_fields(self.name)
        unknown = [
            f for f in fields if f not in NAME_FIELDS and f not in known and f[4:] not in known
        ]
        validated = [f for f in fields if f.startswith("val_") and f[4:] in known]
        problem = None
        if unknown:
            problem = (
                f"uses {{{unknown[0]}}}, which no save knows (placeholders: step, epoch, "
                f"{', '.join(sorted(known))} and their val_ versions)"
            )
        elif validated and not validation:
            problem = f"uses {{{validated[0]}}}, but the run has no validation data"
        elif validated and (self.every_n_steps or self.on_interrupt):
            problem = (
                f"uses {{{validated[0]}}}, which step and interrupt saves (taken mid-epoch, before "
                f"validation) do not have; set checkpoint.policy.every_n_steps=null and "
                f"checkpoint.policy.on_interrupt=false, or name them by a training metric"
            )
        if problem:
            raise ConfigError(
                f"checkpoint.policy.name {problem}. Use {{step}}, {{epoch}} or a logged metric. "
                f"Received: {self.name!r}"
            )


NAME_FIELDS = ("step", "epoch")


def name_fields(pattern: str) -> list[str]:
    """The placeholders of a name pattern; a malformed one is a ``ConfigError``."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
        pattern.format(**{f: 0 if f in NAME_FIELDS else 0.0 for f in fields if f.isidentifier()})
    except (ValueError, IndexError, KeyError, TypeError) as error:
        fields = None
        reason = str(error)
    if fields is None or not all(f.isidentifier() for f in fields):
        raise ConfigError(
            f"checkpoint.policy.name must be a format pattern with named placeholders such as "
            f"'step-{{step:08d}}' or 'epoch-{{epoch:03d}}-{{loss:.3f}}'"
            f"{f' ({reason})' if fields is None else ''}. Received: {pattern!r}"
        )
    return fields


def format_name(pattern: str, *, step: int, epoch: int, metrics: dict[str, float]) -> str:
    """The name of one checkpoint; a placeholder this save lacks is a ``ConfigError``."""
    try:
        return pattern.format(step=step, epoch=epoch, **metrics)
    except KeyError as error:
        raise ConfigError(
            f"checkpoint.policy.name uses {{{error.args[0]}}}, which this save (step {step}) "
            f"does not log. Use {{step}}, {{epoch}} or one of its metrics: "
            f"{', '.join(sorted(metrics)) or 'none'}. Received: {pattern!r}"
        ) from None


class Checkpointer(keras.callbacks.Callback):
    """Saves through ``backend`` per ``policy``; keeps retention records in the state."""

    def __init__(
        self,
        backend: SaveBackend,
        directory: Path,
        policy: CheckpointPolicy,
        state: TrainingState,
        metadata_fn: Callable[[TrainingState], dict[str, Any]],
        progress: Any,
        board: RunBoard | None = None,
        callback_state: Callable[[], dict[str, Any]] | None = None,
    ):
        super().__init__()
        self.backend = backend
        self.directory = Path(directory)
        self.policy = policy
        self.state = state
        self.metadata_fn = metadata_fn
        self.progress = progress
        self.board = board
        self.callback_state = callback_state
        async_save = policy.async_save
        if async_save is None:
            async_save = getattr(backend, "async_by_default", False)
        self.writer = AsyncWriter() if async_save else None
        self._shadow: keras.Model | None = None
        # A resumed run's checkpoint already holds its first step: never save it again.
        self._last_saved_step: int | None = state.global_step or None
        # A step-triggered save waits for the next batch or the epoch end, so a save that
        # falls on an epoch's last batch is taken after validation, as an epoch-end one.
        self._pending_logs: dict[str, Any] | None = None
        self.saved: list[Path] = []
        self.failed: list[Path] = []  # saves that failed under on_save_error=continue
        # "Saved checkpoint" lines, logged by the training thread between progress-bar
        # lines (a background write finishes while the next epoch's bar is being drawn).
        self._done: list[tuple[Path, int, float]] = []
        self._done_lock = threading.Lock()
        for stale in clean_stale_temporaries(self.directory):
            log.warning("Removed an incomplete checkpoint left by a crash: %s", stale)

    # ------------------------------------------------------------------ triggers
    def on_train_batch_begin(self, batch, logs=None):
        if self._pending_logs is not None:
            self.save(self._pending_logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.progress.interrupted:
            self._save_on_interrupt(logs)
            return
        every = self.policy.every_n_steps
        if every and self.state.global_step % every == 0:
            self._pending_logs = dict(logs or {})

    def on_epoch_end(self, epoch, logs=None):
        self.report_saved()  # the bar's line for this epoch is complete
        if self.progress.interrupted:
            self._save_on_interrupt(logs)
            return
        every = self.policy.every_n_epochs
        if self._pending_logs is not None or (every and self.state.epoch % every == 0):
            self.save(logs)
        self.report_saved()

    def finish(self) -> None:
        """End of training: the final save (if due), then wait for any write in flight."""
        if self._pending_logs is not None or (
            self.policy.on_train_end and not self.progress.interrupted
        ):
            self.save(self._pending_logs or self.state.metrics, wait=True)
        self.wait()

    def _save_on_interrupt(self, logs) -> None:
        if self.policy.on_interrupt:
            self.save(logs, wait=True)
        self.report_saved()

    def wait(self) -> None:
        try:
            if self.writer is not None:
                self.writer.wait()
        finally:
            self.report_saved()

    def report_saved(self) -> None:
        """Log the saves completed since the last call (from the training thread only)."""
        with self._done_lock:
            done, self._done = self._done, []
        for path, step, seconds in done:
            log.info("Saved checkpoint %s (step %d) in %.2fs", path, step, seconds)

    # ---------------------------------------------------------------------- save
    def save(self, logs: dict[str, Any] | None, *, wait: bool = False) -> Path | None:
        self._pending_logs = None
        if self._last_saved_step == self.state.global_step:
            return None
        self._last_saved_step = self.state.global_step
        if self.writer is not None:
            self.writer.wait()  # at most one write in flight; raises an earlier failure
        metrics = {k: float(v) for k, v in (logs or {}).items()}
        path = self.directory / format_name(
            self.policy.name, step=self.state.global_step, epoch=self.state.epoch, metrics=metrics
        )
        path = self.backend.checkpoint_path(path)
        record = {
            "name": path.name,
            "step": self.state.global_step,
            "epoch": self.state.epoch,
            "epoch_end": self.state.step_in_epoch == 0,
            "monitor": metrics.get(self.policy.monitor),
        }
        records = [r for r in self.state.extra.get("checkpoints", []) if r["name"] != path.name]
        self.state.extra["checkpoints"] = [*records, record]
        self.state.extra["metric_variables"] = [
            keras.ops.convert_to_numpy(v).tolist() for v in self.model.metrics_variables
        ]
        if self.callback_state is not None:
            self.state.extra["callbacks"] = self.callback_state()
        # A callback (EarlyStopping) ended the run: resuming from here has nothing to do.
        self.state.extra["stopped_early"] = bool(
            self.model.stop_training and not self.progress.interrupted
        )
        state = copy.deepcopy(self.state)
        metadata = self.metadata_fn(state)
        if self.board is not None:
            tag = card_tag("checkpoint", path.name)
            metadata[LINK_KEY] = self.board.link(state.global_step, path, tag=tag)
        if self.writer is None:
            self._write(self.model, path, state, metadata)
        else:
            shadow = self._snapshot()
            self.writer.submit(lambda: self._write(shadow, path, state, metadata))
            if wait:
                self.writer.wait()
        return path

    def _write(
        self, model: keras.Model, path: Path, state: TrainingState, metadata: dict[str, Any]
    ) -> None:
        start = time.perf_counter()
        try:
            self.backend.save(model, path, state=state, metadata=metadata)
        except Exception as error:
            self.state.extra["checkpoints"] = [
                r for r in self.state.extra.get("checkpoints", []) if r["name"] != path.name
            ]
            failure = (
                error
                if isinstance(error, SaveError)
                else SaveError(
                    f"Saving checkpoint {path} failed: {error}. The previous checkpoints in "
                    f"{self.directory} are intact; free space or fix permissions and resume from "
                    f"the latest one. Received error type {type(error).__name__}"
                )
            )
            if self.policy.on_save_error == "continue":
                self.failed.append(path)
                log.error("%s Training continues (checkpoint.on_save_error=continue).", failure)
                return
            if failure is error:
                raise
            raise failure from error
        seconds = time.perf_counter() - start
        self.saved.append(path)
        if self.board is not None:
            self.board.checkpoint_card(
                state.global_step,
                path,
                backend=self.backend.name,
                format_version=self.backend.format_version,
                size_bytes=path_size(path),
                save_seconds=seconds,
                metrics=state.metrics,
            )
        point_latest(self.directory, path)
        self._apply_retention(state)
        with self._done_lock:
            self._done.append((path, state.global_step, seconds))

    def _snapshot(self) -> keras.Model:
        """Bring the shadow model (built once) to the live model's exact state."""
        if self._shadow is None:
            self._shadow = clone_for_snapshot(self.model)
        refresh_snapshot(self.model, self._shadow)
        return self._shadow

    def _apply_retention(self, state: TrainingState) -> None:
        records = self.state.extra.get("checkpoints", [])
        keep = retained(records, self.policy)
        for record in records:
            if record["name"] not in keep:
                remove_path(self.directory / record["name"])
        self.state.extra["checkpoints"] = [r for r in records if r["name"] in keep]


def retained(records: list[dict[str, Any]], policy: CheckpointPolicy) -> set[str]:
    """Names to keep: the newest always, the last N, the best K, every Mth epoch end."""
    if not records:
        return set()
    by_step = sorted(records, key=lambda r: r["step"])
    keep = {by_step[-1]["name"]}
    if policy.keep_last is None:
        keep.update(r["name"] for r in records)
    else:
        keep.update(r["name"] for r in by_step[-policy.keep_last :])
    scored = [r for r in records if r.get("monitor") is not None]
    if policy.keep_best and scored:
        best = sorted(scored, key=lambda r: r["monitor"], reverse=policy.mode == "max")
        keep.update(r["name"] for r in best[: policy.keep_best])
    if policy.keep_every_n_epochs:
        keep.update(
            r["name"]
            for r in records
            if r["epoch_end"] and r["epoch"] and r["epoch"] % policy.keep_every_n_epochs == 0
        )
    return keep


def point_latest(directory: Path, checkpoint: Path) -> None:
    """Atomically repoint ``directory/latest`` (a relative symlink) at ``checkpoint``."""
    link = directory / LATEST
    tmp = temporary_sibling(link)
    os.symlink(checkpoint.name, tmp)
    os.replace(tmp, link)


def all_variables(model: keras.Model) -> list:
    """Every variable whose value a checkpoint holds: weights, RNG seeds, optimizer, metrics."""
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = list(optimizer.variables) if optimizer is not None else []
    return [*model.variables, *optimizer_variables]


def refresh_snapshot(model: keras.Model, shadow: keras.Model) -> None:
    """Copy into ``shadow`` everything a backend would save from ``model``: every variable
    (weights, RNG seeds, optimizer, metrics), then the state that layers keep their own way
    (adapted preprocessing, lookup vocabularies: ``save_own_variables`` / assets), so that
    the background write of the shadow holds what a synchronous save would."""
    for source, target in zip(all_variables(model), all_variables(shadow), strict=True):
        target.assign(source)
    layerstate.copy_own_state(model, shadow)


def clone_for_snapshot(model: keras.Model) -> keras.Model:
    """A second model of the same architecture and compile state, with its own variables."""
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    _call_once_like(model, clone)
    for each in (model, clone):
        modelstate.build_optimizer(each)
    mine, theirs = all_variables(model), all_variables(clone)
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:
        raise SaveError(
            f"Async saving needs a copy of model {model.name!r} rebuilt from its config, but "
            f"the copy's variables differ from the original's. Set checkpoint.async_save=false. "
            f"Received {len(mine)} variables vs {len(theirs)} in the copy"
        )
    return clone


def _call_once_like(model: keras.Model, clone: keras.Model) -> None:
    """A subclassed model knows its input signature (which the SavedModel backend traces
    with) only once called: call the fresh clone once on zeros shaped and typed like the
    live model's inputs. Graph models (Functional, Sequential) know theirs already."""
    try:
        get_input_signature(clone)
        return
    except ValueError:
        pass
    try:
        signature = get_input_signature(model)
    except ValueError:
        return  # the live model was never called either: the backend says so when saving

    def zeros(spec):
        return np.zeros([1 if d is None else d for d in spec.shape], dtype=spec.dtype)

    clone(*keras.tree.map_structure(zeros, signature))


class AsyncWriter:
    """One background write at a time; its failure is raised at the next call, never lost."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run():
            try:
                job()
            except BaseException as error:  # re-raised in the training thread
                self._error = error

        self._thread = threading.Thread(target=run, name="trainer-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
