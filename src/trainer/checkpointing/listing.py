"""What a checkpoint directory holds: its complete checkpoints in step order, the newest,
and the ``latest`` link. Read by the manager, by resume, and by readers that own no manager."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trainer.errors import CorruptCheckpointError, NotACheckpointError, TrainerError
from trainer.save_backends import detect_backend
from trainer.save_backends.base import SaveBackend
from trainer.storage.atomic import temporary_sibling
from trainer.storage.locks import LATEST

log = logging.getLogger(__name__)

# What reading a damaged checkpoint's metadata raises (untrusted content).
_UNREADABLE = (TrainerError, OSError, ValueError, KeyError, TypeError, AttributeError)


def complete(
    directory: Path,
    configured: type[SaveBackend] | None = None,
    damaged: list[tuple[Path, str]] | None = None,
) -> list[tuple[tuple[int, int, str], Path]]:
    """Complete checkpoints with their sort key (step recorded inside, mtime, name);
    ``configured``: also in this (maybe unregistered) backend's format. ``damaged``: if
    given, receives (path, why) of each entry a backend claims (or whose manifest names
    one) but that cannot be read: a crash leaves only hidden temporaries, so a damaged
    checkpoint under a real name is damage, and it is not a candidate either.

    Temporaries are never candidates. Ordering by the step recorded inside each checkpoint
    (not by file times or the ``latest`` link) stays right after a crash between the
    rename and the link update, and after the run directory was copied.
    """
    found = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.name == LATEST or child.name.startswith("."):  # temporaries, leases
                continue
            try:
                cls = detect_backend(child, configured=configured)
            except NotACheckpointError:
                continue  # not a checkpoint at all (a user's file)
            except (TrainerError, OSError) as error:  # a manifest says what it was
                _note(damaged, child, error)
                continue
            try:
                state = cls.read_metadata(child).get("state") or {}
                step = int(state.get("global_step", -1))
            except _UNREADABLE as error:
                _note(damaged, child, error)
                continue
            try:
                found.append(((step, child.stat().st_mtime_ns, child.name), child))
            except FileNotFoundError:  # removed since it was read (retention)
                continue
    return sorted(found, key=lambda item: item[0])


def _note(damaged: list[tuple[Path, str]] | None, path: Path, error: Exception) -> None:
    """Record ``path`` as damaged, unless it is gone: retention (or a replacing save)
    renamed it away while it was being read, which a reader running beside training sees
    (it failed ``resume=latest`` and ``find_latest`` with a CorruptCheckpointError)."""
    if damaged is not None and os.path.lexists(path):
        damaged.append((path, f"{type(error).__name__}: {str(error)[:300]}"))


def complete_checkpoints(
    directory: Path, configured: type[SaveBackend] | None = None
) -> list[Path]:
    """The complete checkpoints of a directory (hidden temporaries left out).

    Args:
        directory: A checkpoint directory.
        configured: A backend class to try when no registered backend claims an entry (the
            run's own ``save._target_``).

    Returns:
        Their paths, oldest step first.
    """
    return [path for _key, path in complete(Path(directory), configured)]


def newest_whole(
    directory: Path, configured: type[SaveBackend] | None = None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The complete checkpoint with the highest step whose files match their manifest
    (sizes and digests: a resume must not start from damaged bytes), or None; and every
    damaged checkpoint met on the way, as (path, why): those whose metadata cannot be read,
    and the newer ones whose files were damaged after they were written."""
    damaged: list[tuple[Path, str]] = []
    found = complete(Path(directory), configured, damaged)
    for _key, path in reversed(found):
        try:
            detect_backend(path, configured=configured)().check_integrity(path, digests=True)
        except (TrainerError, OSError) as error:
            _note(damaged, path, error)
            continue
        return path, damaged
    return None, damaged


def find_latest(directory: Path, configured: type[SaveBackend] | None = None) -> Path:
    """The newest whole checkpoint of a directory.

    Damaged checkpoints are skipped with a warning naming each and why: the run continues
    from the one before (``CheckpointManager.set_aside_after`` then moves the damaged newer
    ones out of the way, whole).

    Args:
        directory: A checkpoint directory.
        configured: See ``complete_checkpoints``.

    Returns:
        The path of the newest checkpoint whose files match their manifest.

    Raises:
        NotACheckpointError: The directory holds no complete checkpoint.
        CorruptCheckpointError: Every checkpoint is damaged: nothing is chosen, since a fresh
            start would write over them.
    """
    chosen, damaged = newest_whole(Path(directory), configured)
    for path, why in damaged:
        log.warning("Skipping damaged checkpoint %s (%s)", path, why)
    if chosen is None and damaged:
        path, why = damaged[0]
        raise CorruptCheckpointError(
            f"Every checkpoint in {directory} is damaged ({len(damaged)}, e.g. {path}), so "
            f"there is nothing to resume from, and a fresh run would write over them. Check "
            f"them with `python -m trainer verify {path}`; restore one from a copy, or move "
            f"them out of {directory} to start afresh. Received error: {why}"
        )
    if chosen is None:
        raise NotACheckpointError(
            f"resume=latest found no complete checkpoint in {directory}. Point resume_dir at "
            f"the run directory that holds checkpoints/, or pass resume=/path/to/checkpoint. "
            f"Received directory {str(directory)!r}"
        )
    return chosen


def point_latest(directory: Path, checkpoint: Path) -> None:
    """Atomically repoint ``directory/latest`` (a relative symlink) at a checkpoint.

    Args:
        directory: The checkpoint directory.
        checkpoint: A checkpoint inside it.
    """
    link = directory / LATEST
    tmp = temporary_sibling(link)
    os.symlink(checkpoint.name, tmp)
    os.replace(tmp, link)
