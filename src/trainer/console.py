"""A quiet console for every entry point: ``train.py``, ``python -m trainer``, ``trainer``.

Why this exists: importing TensorFlow 2.21 prints C++ start-up lines that ignore
``TF_CPP_MIN_LOG_LEVEL`` (absl's "All log messages before absl::InitializeLog()" notice and
CUDA probing such as "Could not find cuda drivers", once per library that carries the
stub, then "failed call to cuInit" on a CPU-only machine); its Python logger installs a
handler of its own when it is first used before the application configured logging
(so under Hydra every TensorFlow line is printed twice); and it logs INFO lines such as
"Assets written to: <temporary directory>" at every SavedModel save. None of that tells a
user anything. ``quiet_tensorflow()`` is called by each entry point before anything
imports TensorFlow; it keeps every warning and error that is not known start-up chatter.

Also: a console that goes away. ``python train.py 2>&1 | tee log`` stopped with Ctrl-C to
the process group loses ``tee`` first; the trainer's next write to the pipe raised
``BrokenPipeError`` (from Keras's progress bar, in the middle of ``fit``), and it exited 1
without a word and without its interrupt checkpoint. ``survive_broken_pipes`` makes such a
write point the stream at ``/dev/null`` and carry on: the run's ``train.log`` still gets
every line.

This module imports no TensorFlow at import time, so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

# C++ log threshold: 1 hides INFO, keeps warnings and errors (a user's own setting wins).
CPP_LOG_LEVEL = "1"

# Lines TensorFlow prints while it is imported or probes its devices that say nothing
# about the user's run. Each is only dropped inside that window.
_CHATTER = [
    re.compile(p)
    for p in (
        r"All log messages before absl::InitializeLog\(\) is called are written to STDERR",
        r"cudart_stub\.cc.*Could not find cuda drivers",
        r"Unable to register cu(DNN|FFT|BLAS) factory",
        r"oneDNN custom operations are on",
        r"This TensorFlow binary is optimized to use available CPU instructions",
        r"To enable the following instructions: .* rebuild TensorFlow",
        r"TF-TRT Warning: Could not find TensorRT",
    )
]
_NO_DRIVER = re.compile(r"Could not find cuda drivers")
# cuInit failing is expected (and hidden) only where no CUDA driver was found at all; on a
# machine with a driver it is a real problem and is shown.
_CUINIT = re.compile(r"failed call to cuInit")

# Python loggers whose INFO lines are TensorFlow's internals, not the run's progress.
QUIET_LOGGERS = ("tensorflow", "absl")


class StartupFilter:
    """Decides, line by line, whether a start-up line is shown."""

    def __init__(self) -> None:
        self.no_driver = False

    def keep(self, line: str) -> bool:
        if _NO_DRIVER.search(line):
            self.no_driver = True
        chatter = any(p.search(line) for p in _CHATTER)
        return not (chatter or (self.no_driver and _CUINIT.search(line)))


class PipeSafeStream:
    """``sys.stdout`` or ``sys.stderr`` whose writes survive the reader of its pipe going
    away: the first ``BrokenPipeError`` points the stream's file descriptor at
    ``/dev/null`` (C++ writes to it included), logs one warning (which the run's log file
    still receives), and every later write succeeds there. Everything else is the wrapped
    stream's own."""

    def __init__(self, stream: TextIO, name: str):
        self.stream = stream
        self.name = name  # "stdout" or "stderr", for the warning
        self.dropped = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self.stream, name)

    def _drop(self) -> None:
        if self.dropped:
            return
        self.dropped = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor: writes keep failing
            return
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()  # what the pipe refused goes to /dev/null
        logging.getLogger(__name__).warning(
            "The console's %s is a pipe whose reader has gone (e.g. `| tee` ended by "
            "Ctrl-C): its output now goes to /dev/null; the run goes on and logs to its log "
            "file",
            self.name,
        )


EXIT_READER_GONE = 141  # 128 + SIGPIPE: what a shell reports for a program SIGPIPE ended


def reader_gone() -> int:
    """A command whose stdout reader went away (``trainer runs outputs | head``) stops
    quietly, as ``ls | head`` does: stdout is pointed at ``/dev/null`` so that Python's
    final flush cannot print a BrokenPipeError traceback; returns the exit code a program
    ended by SIGPIPE has, so that a ``pipefail`` script still sees the output was cut."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_READER_GONE


def survive_broken_pipes() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in ``PipeSafeStream`` (once). Call it before
    logging is configured: handlers keep the stream object they were given."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeSafeStream):
            setattr(sys, name, PipeSafeStream(stream, name))


def quiet_tensorflow() -> None:
    """Set TensorFlow's log levels, then import it and probe its devices with the known
    start-up chatter filtered out of stderr; route its Python log lines through the
    application's logging (once) at WARNING and above. Safe to call more than once."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", CPP_LOG_LEVEL)
    for name in QUIET_LOGGERS:  # a Hydra job_logging config can still lower them
        logging.getLogger(name).setLevel(logging.WARNING)
    if "tensorflow" not in sys.modules:
        with filtered_stderr(StartupFilter()):
            import tensorflow as tf

            tf.config.list_physical_devices()  # CUDA probing happens here, not at import
    import tensorflow as tf

    # TensorFlow's own handler duplicates every line once Hydra (or the user) configures
    # the root logger; without it, its warnings still reach the root logger's handlers.
    tf_logger = tf.get_logger()
    for handler in list(tf_logger.handlers):
        tf_logger.removeHandler(handler)
    tf_logger.propagate = True


@contextlib.contextmanager
def filtered_stderr(line_filter: StartupFilter) -> Iterator[StartupFilter]:
    """While active, everything written to file descriptor 2 (C++ included) passes
    through ``line_filter``; kept lines reach the real stderr as they are written."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError, AttributeError):  # no real stderr (embedded, closed)
        yield line_filter
        return
    forward_to = os.dup(saved)
    thread = threading.Thread(
        target=_forward, args=(read_end, forward_to, line_filter), daemon=True
    )
    thread.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield line_filter
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees its end
        os.close(saved)
        thread.join(timeout=10)  # a child process may still hold the pipe: never hang


def _forward(read_end: int, out: int, line_filter: StartupFilter) -> None:
    """Copy the kept lines to ``out``; once ``out`` refuses them (a closed pipe), read on
    and drop them, so that writers to descriptor 2 never block or fail."""
    pending = b""
    writable = True

    def emit(data: bytes) -> None:
        nonlocal writable
        if writable:
            try:
                os.write(out, data)
            except OSError:
                writable = False

    try:
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line_filter.keep(line.decode(errors="replace")):
                    emit(line + b"\n")
        if pending and line_filter.keep(pending.decode(errors="replace")):
            emit(pending)
    finally:
        os.close(read_end)
        os.close(out)
