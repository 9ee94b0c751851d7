"""Resuming: find the checkpoint to continue from, check it fits the config, restore state.

The model is always built from the *current* config and the checkpoint's values are copied
into it by position. That keeps the resumed model the same Python object graph a fresh run
would have, and turns an architecture change into a clear error instead of a silent
mismatch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.checkpointing import LATEST, find_latest, restore_into
from trainer.errors import ConfigMismatchError
from trainer.save_backends import detect_backend

__all__ = ["check_compatible", "find_latest", "resolve_resume", "restore_into", "run_dir_of"]

log = logging.getLogger(__name__)

# Config sections that define the model's variables; anything else (epochs, checkpoint
# policy, verbosity...) may change between the original run and the resumed one.
ARCHITECTURE_KEYS = ("model", "data", "optimizer", "schedule", "seed", "wrap")


# Where a run keeps its checkpoints unless `checkpoint.directory` says otherwise.
CHECKPOINT_DIR = "checkpoints"


def resolve_resume(
    resume: str | None, resume_dir: str | None, run_dir: Path, dirname: str = CHECKPOINT_DIR
) -> Path | None:
    """The checkpoint named by ``resume`` (``latest``, a checkpoint or a run directory), or
    None for a fresh run. ``dirname`` is the run's checkpoint sub-directory."""
    if not resume:
        return None
    if str(resume) == LATEST:
        directory = Path(resume_dir) if resume_dir else run_dir
        return find_latest(checkpoint_dir_of(directory, dirname))
    path = Path(resume).expanduser()
    if path.is_dir() and (path / dirname).is_dir():  # a run directory
        return find_latest(path / dirname)
    detect_backend(path)  # raises a clear error if it is not a checkpoint
    return path


def checkpoint_dir_of(directory: Path, dirname: str = CHECKPOINT_DIR) -> Path:
    return directory / dirname if (directory / dirname).is_dir() else directory


def run_dir_of(checkpoint: Path, dirname: str = CHECKPOINT_DIR) -> Path | None:
    """The run directory a checkpoint belongs to (``<run>/<dirname>/<name>``), if any."""
    parent = checkpoint.resolve().parent
    tail = Path(dirname).parts
    if tail and parent.parts[-len(tail) :] == tail:
        return Path(*parent.parts[: -len(tail)])
    return None


def check_compatible(cfg: DictConfig, metadata: dict[str, Any], where: Path) -> None:
    """Refuse to resume when the config changes what the checkpoint's variables mean."""
    stored = metadata.get("config")
    if not isinstance(stored, dict):
        return  # saved outside `train`: only the variable shapes can be compared
    current = OmegaConf.to_container(cfg, resolve=True)
    differences = []
    for key in ARCHITECTURE_KEYS:
        if key in stored:  # a section added by a later trainer version is not a change
            differences += _diff(stored[key], current.get(key), key)
    if differences:
        shown = "; ".join(differences[:8])
        raise ConfigMismatchError(
            f"The config disagrees with checkpoint {where}: {shown}. Resume with the "
            f"checkpoint's settings (see its metadata: python -m trainer inspect {where}) or "
            f"start a fresh run. Only settings such as trainer.epochs may change on resume."
        )


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    return [] if old == new else [f"{prefix} is {old!r} in the checkpoint but {new!r} now"]


def resume_hint(path: Path, dirname: str = CHECKPOINT_DIR) -> str:
    run = run_dir_of(path, dirname)
    if run is not None:
        return f"python train.py resume=latest resume_dir={os.fspath(run)}"
    return f"python train.py resume={os.fspath(path)}"
