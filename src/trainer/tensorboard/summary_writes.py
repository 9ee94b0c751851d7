"""Every TensorBoard write of a run under ``checkpoint.policy.on_save_error``.

TensorBoard curves and cards are a by-product of training: with ``continue`` a full disk or
a lost permission must not end a run that the checkpoint policy lets go on, and with
``raise`` it must end it with a ``TrainerError`` saying what to do, never with the raw
``ResourceExhaustedError`` / ``OutOfRangeError`` TensorFlow's summary writer raises.

A failing log usually fails at every step; so ``continue`` logs one warning per kind of
write and error type, counts the rest, and says how many failed when the writer closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import tensorflow as tf

from trainer.errors import TensorBoardWriteError

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "continue")


class SummaryWrites:
    """Runs the TensorBoard writes into ``log_dir`` under ``on_error`` (the run's
    ``checkpoint.policy.on_save_error``): ``raise`` turns a failed write into a
    ``TensorBoardWriteError``, ``continue`` into one logged warning per kind of failure."""

    def __init__(self, log_dir: str | os.PathLike, on_error: str = "raise"):
        if on_error not in ON_ERROR:
            raise ValueError(
                f"on_error must be 'raise' or 'continue' (checkpoint.policy.on_save_error). "
                f"Received: {on_error!r}"
            )
        self.log_dir = Path(log_dir)
        self.on_error = on_error
        self.failures: dict[str, int] = {}  # kind of write -> failed writes
        self._warned: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Run the block's writes; a failure is raised or logged as the policy says. The
        block is left at the failing write: what follows it in the block is skipped.
        ``what`` names the operation ("creating the log directory", "writing batch
        scalars"): messages read "TensorBoard log DIR: <what> failed"."""
        try:
            yield
        except (tf.errors.OpError, OSError) as error:
            self._failed(what, error)

    def _failed(self, what: str, error: Exception) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1
        reason = f"{type(error).__name__}: {_first_line(error)}"
        # close() while an error already ends training: that error must win, not this one.
        ending = what == "closing the event file" and sys.exc_info()[1] is not None
        if self.on_error == "raise" and not ending:
            raise TensorBoardWriteError(
                f"TensorBoard log {self.log_dir}: {what} failed, so training stopped "
                f"(checkpoint.policy.on_save_error=raise). Free space or fix the permissions "
                f"of {self.log_dir} and resume from the latest checkpoint, or set "
                f"checkpoint.policy.on_save_error=continue to train on without these "
                f"TensorBoard entries. Received: {reason}"
            ) from error
        key = (what, type(error).__name__)
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning(
            "TensorBoard log %s: %s failed; the run continues without these entries "
            "(checkpoint.policy.on_save_error=continue), and further failures of this kind "
            "are not logged. Received: %s",
            self.log_dir,
            what,
            reason,
        )

    def report(self) -> None:
        """Log how many writes failed in all (under ``continue``), once, at the end."""
        if self.failures:
            counts = ", ".join(f"{n} x {what}" for what, n in sorted(self.failures.items()))
            log.warning("TensorBoard log %s: writes that failed in all: %s", self.log_dir, counts)
            self.failures = {}


def open_writer(writes: SummaryWrites, log_dir: Path, **options) -> tf.summary.SummaryWriter | None:
    """A summary writer into ``log_dir``, or None when it cannot even be opened (and the
    policy is ``continue``): the caller then writes nothing."""
    with writes.writing("opening the event file"):
        return tf.summary.create_file_writer(str(log_dir), **options)
    return None


def _first_line(error: Exception) -> str:
    """The error's message without TensorFlow's ``{{function_node ...}}`` prefix."""
    text = getattr(error, "message", None) or str(error)
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(text))
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return "; ".join(lines[:3])[:300]
