"""What ``CheckpointManager`` does differently when its directory is on object storage:
retention and setting aside, through the commit markers (``trainer.storage.remote``).

On disk both move whole directories by rename; a store has no rename, so they act on the
markers, which alone make a checkpoint visible: retention deletes a marker before the
objects, setting aside moves only the markers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.checkpointing.set_aside import ABANDONED
from trainer.storage.locks import remove_unless_read
from trainer.storage.remote import RemoteCheckpoints

log = logging.getLogger(__name__)


def prune(
    remote: RemoteCheckpoints, staging: Path, records: list[dict[str, Any]], keep: set[str]
) -> list[str]:
    """Delete every recorded checkpoint not in ``keep`` from the store (marker first, then
    its objects: ``RemoteCheckpoints.delete``), then its local staged copy. Returns the
    names deleted."""
    gone = []
    for record in records:
        if record["name"] in keep:
            continue
        remote.delete(record["name"], report=False)
        remove_unless_read(staging / record["name"])
        gone.append(record["name"])
    return sorted(gone)


def clean(remote: RemoteCheckpoints) -> list[str]:
    """Right after this writer took the directory's lease: delete the objects a killed
    writer left without a marker (``RemoteCheckpoints.clean_leftovers``). Returns their
    names."""
    removed = remote.clean_leftovers()
    for name in removed:
        log.warning(
            "Removed the objects of %s, left without a commit marker by a writer that "
            "stopped during an upload or a delete",
            remote.url_of(name),
        )
    return removed


def set_aside_after(remote: RemoteCheckpoints, step: int) -> str | None:
    """Training continues from a checkpoint at ``step`` older than the store's newest: the
    markers of the later ones move to ``abandoned-<n>/`` (their objects stay), and
    ``latest`` names the newest one left. Returns the folder's URL, or None."""
    found = remote.committed()
    later = [m["name"] for m in found if m["step"] > step]
    if not later:
        return None
    taken = set(remote.store.list(""))
    n = 1
    while f"{ABANDONED}{n}" in taken:
        n += 1
    folder = f"{ABANDONED}{n}"
    remote.set_aside(later, folder)
    remaining = [m["name"] for m in found if m["step"] <= step]
    if remaining:
        remote.point_latest(remaining[-1])
    log.warning(
        "Resuming from step %d, older than the newest checkpoint: the %d checkpoint(s) "
        "after it (%s) belong to the abandoned continuation; their commit markers were "
        "moved to %s (the objects stay)",
        step,
        len(later),
        ", ".join(later[:5]),
        remote.url_of(folder),
    )
    return remote.url_of(folder)
