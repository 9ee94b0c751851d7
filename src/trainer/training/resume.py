"""Resuming: find the checkpoint to continue from, check it fits the config, restore state.

The model is always built from the *current* config and the checkpoint's values are copied
into it by position. That keeps the resumed model the same Python object graph a fresh run
would have, and turns an architecture change into a clear error instead of a silent
mismatch.
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.checkpointing import (
    ABANDONED,
    LATEST,
    complete_checkpoints,
    find_latest,
    restore_into,
)
from trainer.errors import ConfigError, ConfigMismatchError, NotACheckpointError
from trainer.exports.exporter import is_export
from trainer.save_backends import SaveBackend, detect_backend
from trainer.state import TrainingState

__all__ = [
    "check_compatible",
    "find_latest",
    "resolve_resume",
    "restore_into",
    "resume_hint",
    "run_dir_of",
]

log = logging.getLogger(__name__)

# Config sections that define the model's variables; anything else (epochs, checkpoint
# policy, verbosity...) may change between the original run and the resumed one.
# ``strategy.scale_lr`` multiplies the configured rate: a resume that turned it on or off
# scaled a schedule's rate but not a constant one (restored from the optimizer's variable).
ARCHITECTURE_KEYS = ("model", "optimizer", "schedule", "wrap", "strategy.scale_lr")
# Keys that decide which examples each step trains on. Changing one does not change what
# the variables mean, but the resumed run no longer matches an uninterrupted one: refused
# unless ``resume_allow_inexact=true``. The ``trainer.*`` ones only matter in the middle of
# an epoch (the resumed epoch skips the batches already trained, counted in batches).
EXACTNESS_KEYS = ("data", "seed")
MID_EPOCH_KEYS = ("trainer.batch_size", "trainer.steps_per_epoch")
AUTO = "auto"
PRUNING_END = "wrap.end_step"
# Overrides that choose what to resume; the printed resume command sets them itself.
RESUME_KEYS = ("resume", "resume_dir")

# Where a run keeps its checkpoints unless `checkpoint.directory` says otherwise.
CHECKPOINT_DIR = "checkpoints"


def resolve_resume(
    resume: str | None,
    resume_dir: str | None,
    run_dir: Path,
    dirname: str = CHECKPOINT_DIR,
    configured: type[SaveBackend] | None = None,
) -> Path | None:
    """The checkpoint named by ``resume``, or None for a fresh run. ``dirname`` is the
    run's checkpoint sub-directory. ``latest``: the newest complete checkpoint of
    ``resume_dir`` (else of ``run_dir``), an error if there is none; ``auto``: the same, or
    None (a fresh run) if there is none, so a preempted job can re-run one command; else a
    checkpoint or a run directory. A serving export is refused: it is not a checkpoint of
    the run and resuming from it would start a new run directory. ``configured``: the
    run's own backend class, which reads its checkpoints even when it is not registered."""
    if not resume:
        return None
    if str(resume) in (LATEST, AUTO):
        directory = Path(resume_dir).expanduser() if resume_dir else run_dir
        refuse_export(directory, f"resume_dir={resume_dir}", dirname)
        try:
            return find_latest(checkpoint_dir_of(directory, dirname), configured)
        except NotACheckpointError:
            if str(resume) == LATEST:
                raise
        log.info(
            "resume=auto: no complete checkpoint in %s yet; starting a fresh run",
            checkpoint_dir_of(directory, dirname),
        )
        return None
    path = Path(resume).expanduser()
    refuse_export(path, f"resume={resume}", dirname)
    if path.is_dir() and (path / dirname).is_dir():  # a run directory
        return find_latest(path / dirname, configured)
    detect_backend(path, configured=configured)  # raises a clear error if it is not a checkpoint
    return path


def refuse_export(path: Path, received: str, dirname: str = CHECKPOINT_DIR) -> None:
    """Raise if ``path`` is a serving export (``<run>/export/<version>``): training
    continues from the run's checkpoints, which hold the full training state."""
    if not path.is_dir() or not is_export(path):
        return
    run = path.resolve().parent.parent
    instead = (
        f"resume=latest resume_dir={run}"
        if (run / dirname).is_dir()
        else "resume=/path/to/run/checkpoints/<checkpoint>"
    )
    raise NotACheckpointError(
        f"{path} is a serving export, not a training checkpoint: training resumes from the "
        f"run's checkpoints (weights, optimizer, data position), not from what it exported. "
        f"Resume with {instead}. Received: {received}"
    )


def checkpoint_dir_of(directory: Path, dirname: str = CHECKPOINT_DIR) -> Path:
    return directory / dirname if (directory / dirname).is_dir() else directory


def run_dir_of(checkpoint: Path, dirname: str = CHECKPOINT_DIR) -> Path | None:
    """The run directory a checkpoint belongs to (``<run>/<dirname>/<name>``, or
    ``<run>/<dirname>/abandoned-<n>/<name>`` for one a resume set aside), if any."""
    parent = checkpoint.resolve().parent
    if parent.name.startswith(ABANDONED) and parent.name[len(ABANDONED) :].isdigit():
        parent = parent.parent
    tail = Path(dirname).parts
    if tail and parent.parts[-len(tail) :] == tail:
        return Path(*parent.parts[: -len(tail)])
    return None


def refuse_fresh_over(run_dir: Path, dirname: str, configured: type[SaveBackend]) -> None:
    """Refuse a fresh run (no ``resume``) in a run directory whose checkpoint directory
    holds an earlier run's checkpoints: its saves replaced those of the same names, left
    the later ones, and a later ``resume=latest`` continued the earlier run."""
    directory = Path(run_dir) / dirname
    found = complete_checkpoints(directory, configured) if directory.is_dir() else []
    if found:
        raise ConfigError(
            f"{run_dir} already holds {len(found)} checkpoint(s) of an earlier run in "
            f"{directory}; a fresh run there would replace them. Continue that run with "
            f"resume=auto (or resume=latest), or start this one in a new directory "
            f"(hydra.run.dir=... or run_dir=...). Received: newest {found[-1].name}, "
            f"resume=null"
        )


def check_compatible(
    cfg: DictConfig,
    metadata: dict[str, Any],
    where: Path,
    state: TrainingState | None = None,
) -> None:
    """Refuse to resume when the config changes what the checkpoint's variables mean, or
    (unless ``resume_allow_inexact``) which examples the remaining steps train on."""
    stored = metadata.get("config")
    if not isinstance(stored, dict):
        return  # saved outside `train`: only the variable shapes can be compared
    current = OmegaConf.to_container(cfg, resolve=True)
    differences = [
        d  # where the pruning schedule ends changes no variable: checked as exactness below
        for d in _differences(stored, current, ARCHITECTURE_KEYS)
        if not d.startswith(f"{PRUNING_END} ")
    ]
    if differences:
        shown = "; ".join(differences[:8])
        raise ConfigMismatchError(
            f"The config disagrees with checkpoint {where}: {shown}. Resume with the "
            f"checkpoint's settings (see its metadata: python -m trainer inspect {where}) or "
            f"start a fresh run. Only settings such as trainer.epochs may change on resume. "
            f"Received: {', '.join(_keys(differences))}"
        )
    mid_epoch = state is not None and state.step_in_epoch > 0
    keys = EXACTNESS_KEYS + (MID_EPOCH_KEYS if mid_epoch else ())
    inexact = _differences(stored, current, keys) + _pruning_restarts(stored, current, state)
    if not inexact:
        return
    shown = "; ".join(inexact[:8])
    where_in_run = (
        f"in the middle of epoch {state.epoch + 1} (after {state.step_in_epoch} of its batches)"
        if mid_epoch
        else f"at step {state.global_step if state else '?'}"
    )
    if cfg.get("resume_allow_inexact"):
        log.warning(
            "Resuming %s from %s with changed settings (%s): resume_allow_inexact=true, so "
            "the run continues but no longer matches an uninterrupted one",
            where_in_run,
            where,
            shown,
        )
        return
    raise ConfigMismatchError(
        f"Resuming {where_in_run} from {where} with changed settings would train on other "
        f"examples than the interrupted run: {shown}. Resume with the checkpoint's values, "
        f"or pass resume_allow_inexact=true to continue knowing the result no longer matches "
        f"an uninterrupted run. Received: {', '.join(_keys(inexact))}"
    )


def _pruning_restarts(
    stored: dict[str, Any], current: dict[str, Any], state: TrainingState | None
) -> list[str]:
    """Pruning with ``wrap.end_step=null`` ends its schedule at the run's last step, which
    ``trainer.epochs`` decides: a resume with more (or fewer) epochs restarted the schedule
    at another sparsity, and weights already pruned came back. Setting ``wrap.end_step`` to
    where the first session's schedule ended continues it exactly."""
    wrap, before = current.get("wrap") or {}, stored.get("wrap") or {}
    if not isinstance(wrap, dict) or "end_step" not in wrap or not isinstance(before, dict):
        return []
    derived = None  # where a null end_step ended the checkpoint's schedule
    if state is not None and state.epoch and not state.step_in_epoch:
        epochs = (stored.get("trainer") or {}).get("epochs")
        if isinstance(epochs, int):
            derived = state.global_step // state.epoch * epochs
    was, now = before.get("end_step"), wrap.get("end_step")
    if was is not None or now is not None:
        same = now == (was if was is not None else derived)
        return [] if same else [f"{PRUNING_END} is {was!r} in the checkpoint but {now!r} now"]
    keys = ("trainer.epochs", "trainer.steps_per_epoch", "trainer.batch_size")
    if not _differences(stored, current, keys):
        return []
    end = derived if derived is not None else "the step the first session's schedule ended"
    return [
        f"{PRUNING_END} (null: the pruning schedule ends at the run's last step, which "
        f"trainer.epochs moves, so the schedule would restart and pruned weights come back; "
        f"set {PRUNING_END}={end} to continue it)"
    ]


def _differences(stored: dict[str, Any], current: dict[str, Any], keys) -> list[str]:
    differences: list[str] = []
    for key in keys:
        head, _, tail = key.partition(".")
        old, new = stored.get(head), current.get(head)
        if head not in stored:  # a section added by a later trainer version is not a change
            continue
        if tail:
            if not isinstance(old, dict) or tail not in old:
                continue
            old, new = old.get(tail), (new or {}).get(tail)
        differences += _diff(old, new, key)
    return differences


def _keys(differences: list[str]) -> list[str]:
    return [d.split(" ", 1)[0] for d in differences]


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    return [] if old == new else [f"{prefix} is {old!r} in the checkpoint but {new!r} now"]


def resume_hint(
    path: Path, dirname: str = CHECKPOINT_DIR, overrides: list[str] | tuple[str, ...] = ()
) -> str:
    """The command that resumes from ``path``: the run's own ``overrides`` (so the config
    matches the checkpoint's) with the resume keys set to it."""
    kept = [o for o in overrides if _override_key(o) not in RESUME_KEYS]
    run = run_dir_of(path, dirname)
    target = (
        ["resume=latest", f"resume_dir={os.fspath(run)}"]
        if run is not None
        else [f"resume={os.fspath(path)}"]
    )
    return shlex.join(["python", "train.py", *kept, *target])


def _override_key(override: str) -> str:
    """``model=mlp`` -> ``model``; ``+a.b=1`` / ``~a`` / ``++a=1`` -> ``a.b`` / ``a``."""
    return override.split("=", 1)[0].lstrip("+~")


def run_overrides(run_dir: Path | None = None) -> list[str]:
    """The command-line overrides of this session (Hydra's task overrides), else those
    Hydra recorded in ``run_dir/.hydra/overrides.yaml``; [] outside Hydra."""
    if HydraConfig.initialized():
        return [str(o) for o in HydraConfig.get().overrides.task]
    recorded = Path(run_dir or ".") / ".hydra" / "overrides.yaml"
    try:
        loaded = OmegaConf.load(recorded)
    except Exception:  # missing or not YAML: the hint then names no overrides
        return []
    return [str(o) for o in loaded] if isinstance(loaded, ListConfig) else []
