"""A rehearsal write: pay a backend's first-save work before the first real save.

The SavedModel backend traces a model on its first save and reuses that trace for every
later save of the same model (``reuse_traces``). For async checkpointing that first write
(1.5-3 s of CPU on the default model) used to run right after the first epoch's save and
make the *second* save wait for it (issue 17). Rehearsing it on the shadow model at the
start of training moves that work into the first epoch, where nothing waits for it. One
write traces the model; a backend that can also trace its repeat-save writes
(``prepare_repeat_saves``) does so next, in the same directory.

The rehearsal writes into a fresh directory under the system's temporary directory, never
into the checkpoint directory (whose contents crash, disk-full and concurrent-reader tests
pin), and removes it. Its name carries the writing process's id, so a rehearsal that a
crash left behind is removed by the next one (``remove_stale``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import keras

from trainer.storage.atomic import process_alive

log = logging.getLogger(__name__)
PREFIX = "trainer-rehearsal-"
_OWNER = re.compile(rf"^{PREFIX}([0-9]+)-")


def worth_rehearsing(backend: Any) -> bool:
    """Whether ``backend`` (the real one, under its wrappers) caches work on its first save
    of a model that a rehearsal would pay in advance: a directory backend that reuses
    traces. Other backends do the same work on every save; rehearsing them only costs."""
    return bool(getattr(backend, "reuse_traces", False)) and bool(
        getattr(backend, "is_directory", False)
    )


def rehearse(backend: Any, model: keras.Model, real: Any = None) -> None:
    """Write ``model`` through ``backend`` once into a temporary directory outside any
    checkpoint directory, then remove it. Nothing is published or sealed (``write_into``):
    no manifest hashing, no rename, no ``latest``. ``real``: the backend under
    ``backend``'s wrappers, asked to ``prepare_repeat_saves`` if it can."""
    remove_stale()
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    try:
        backend.write_into(model, root / "write")
        prepare = getattr(real if real is not None else backend, "prepare_repeat_saves", None)
        if prepare is not None:
            prepare(model, root / "repeat")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def remove_stale(directory: str | os.PathLike | None = None) -> list[Path]:
    """Remove rehearsal directories whose process is gone (killed mid-rehearsal)."""
    directory = Path(directory or tempfile.gettempdir())
    removed = []
    try:
        children = list(directory.iterdir())
    except OSError:
        return removed
    for child in children:
        owner = _OWNER.match(child.name)
        if owner is None or int(owner.group(1)) == os.getpid():
            continue
        if not process_alive(int(owner.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed
