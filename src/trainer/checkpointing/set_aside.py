"""Setting aside, on disk, the checkpoints of a continuation that a resume from an older
checkpoint abandoned (``CheckpointManager.set_aside_after``; ``on_store.set_aside_after``
does the same through a store's commit markers).

Nothing is deleted: the later checkpoints move, whole, into ``abandoned-<n>/`` of the
directory, so that ``resume=latest`` continues the resumed branch instead of jumping back,
and no save of that branch replaces one of them under the same name.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trainer.checkpointing.listing import complete, point_latest
from trainer.save_backends.base import SaveBackend
from trainer.storage.atomic import first_unused

# The manager's logger (``trainer.checkpointing.manager``): this line predates the split.
log = logging.getLogger("trainer.checkpointing.manager")

# Sub-directory prefix of a checkpoint directory for the checkpoints of a continuation that
# a resume from an older checkpoint abandoned (``CheckpointManager.set_aside_after``).
ABANDONED = "abandoned-"
"""Prefix of ``abandoned-<n>/``, where a resume from an older checkpoint moves the newer ones."""


def set_aside_after(directory: Path, configured: type[SaveBackend], step: int) -> Path | None:
    """Move the checkpoints of ``directory`` after ``step``, and the damaged ones (of no
    known step), into a new ``abandoned-<n>/``; point ``latest`` at the newest one left.

    Args:
        directory: The local checkpoint directory.
        configured: The class of the manager's own backend (it reads what it wrote).
        step: The step of the checkpoint training continues from.

    Returns:
        The ``abandoned-<n>`` folder, or None if there was nothing to move.
    """
    damaged: list[tuple[Path, str]] = []
    found = complete(directory, configured, damaged)
    later = [path for key, path in found if key[0] > step]
    unreadable = [path for path, _why in damaged]  # of no known step: any name may come
    if not later and not unreadable:
        return None
    folder = first_unused(lambda n: directory / f"{ABANDONED}{n}")
    folder.mkdir()
    for path in later + unreadable:
        os.rename(path, folder / path.name)
    remaining = [path for key, path in found if key[0] <= step]  # still in step order
    if remaining:
        point_latest(directory, remaining[-1])
    log.warning(
        "Resuming from step %d, older than the newest checkpoint: the %d checkpoint(s) "
        "after it or damaged (%s) belong to the abandoned continuation and were moved "
        "to %s",
        step,
        len(later) + len(unreadable),
        ", ".join(p.name for p in (later + unreadable)[:5]),
        folder,
    )
    return folder
