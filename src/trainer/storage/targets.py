"""What is at a checkpoint path, for the shared ``SaveBackend`` logic: whether a save may
replace it (only a trainer checkpoint or an empty directory, never a user's data), whether
anything is there at all, and which backend's checkpoint it is (the registry, which sits
above the backends, installs that detector here).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.errors import CorruptCheckpointError, NotACheckpointError, SaveError, TrainerError
from trainer.storage.atomic import is_temporary

# Path -> the ``SaveBackend`` class whose checkpoint it is (or a ``TrainerError``).
_format_detector: Callable[[Path], type[Any]] | None = None


def format_detector() -> Callable[[Path], type[Any]] | None:
    return _format_detector


def set_format_detector(detector: Callable[[Path], type[Any]]) -> None:
    """Called by the registry, which sits above this module: a backend asked to load
    another backend's checkpoint names the right one without importing the registry."""
    global _format_detector
    _format_detector = detector


def check_replaceable(path: Path, backend: type[Any]) -> None:
    """Refuse to save over anything but one of our checkpoints (or an empty directory).

    A save replaces its target atomically, so an existing directory or file at ``path``
    would be deleted with everything in it: only a checkpoint trainer wrote (intact or
    damaged) may be replaced, never a user's data.
    """
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return
    if not is_temporary(path) and backend.can_load(path):
        return
    if _format_detector is not None:
        try:
            _format_detector(path)
            return  # another backend's checkpoint: ours to replace
        except CorruptCheckpointError:
            return  # one of ours, damaged (its manifest told)
        except TrainerError:
            pass
    kind = "directory" if path.is_dir() else "file"
    raise SaveError(
        f"{path} already exists and is a {kind} that is not a trainer checkpoint; saving "
        f"there would replace it and everything in it. Save to a new path, or move it away "
        f"yourself if it is really unwanted. Received: {str(path)!r}"
    )


def check_exists(path: Path) -> None:
    """``NotACheckpointError`` for a missing path, saying so when a symlink loop hides it."""
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            problem = "its symbolic links form a loop"
        elif error.errno == errno.ENOTDIR:
            problem = "a file stands where a directory is expected in the path"
        elif error.errno == errno.ENOENT:
            problem = "the path does not exist"
        else:
            problem = f"it cannot be accessed ({error.strerror})"
        raise NotACheckpointError(
            f"No checkpoint at {path}: {problem}. Check the path, or list a run's "
            f"checkpoints with `python -m trainer runs`. Received: {str(path)!r}"
        ) from None
