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

This module imports no TensorFlow at import time, so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

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
    pending = b""
    try:
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line_filter.keep(line.decode(errors="replace")):
                    os.write(out, line + b"\n")
        if pending and line_filter.keep(pending.decode(errors="replace")):
            os.write(out, pending)
    finally:
        os.close(read_end)
        os.close(out)
