"""Files a backend has finished before its save ends, told to whoever asked.

A checkpoint on object storage is uploaded after the backend's local write, and most of a
large model's bytes sit in one file the backend finishes well before the save ends (the
savedmodel backend's ``variables/variables.data-*``, before its index, fingerprint,
metadata, manifest and fsync). A backend calls ``finished`` for such a file; a caller
that wraps the save in ``listening`` hears of it and may start uploading it while the rest
of the local write goes on (``trainer.storage.early``). Nothing is promised beyond the
file: the save may still fail, so a listener must keep what it does with it unpublished
until the save returns.

A context variable, not a parameter: the save's call chain runs through the backend's own
layers (``SaveBackend.save``, its ``_write``, the savedmodel trace cache) that have nothing
to do with storage, and every save runs in one thread (the caller's or the writer's).
Backends that never call ``finished`` need nothing: the caller then uploads every file
after the save, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# (the checkpoint's directory being written, the file's path relative to it, its size,
# its SHA-256 as the backend computed it while writing the bytes)
Listener = Callable[[Path, str, int, str], None]
_LISTENER: contextvars.ContextVar[Listener | None] = contextvars.ContextVar(
    "trainer_early_files", default=None
)


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """Inside: ``finished`` calls of this thread's saves go to ``listener`` (None: to
    nobody)."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def finished(directory: Path, relative: str, size: int, sha256: str) -> None:
    """Tell the listener, if any, that ``directory/relative`` is written for good: the
    save will not change it again, and ``size`` and ``sha256`` are its bytes' (the ones the
    manifest will record). A listener's failure is logged, never the save's: the caller
    uploads the file after the save anyway."""
    listener = _LISTENER.get()
    if listener is None:
        return
    try:
        listener(Path(directory), relative, size, sha256)
    except Exception as error:  # the upload after the save covers it
        log.debug("Early use of %s/%s skipped: %s", directory, relative, error)
