"""SIGTERM and SIGINT, phase by phase: the one stack of signal handlers, and the signal that
ended a training session.

Why one stack: a run passes through phases that each answer a signal differently. Start-up
(train.py, before the run is set up) exits at once with one line; a sweep remembers it and
starts no further job; the set-up and the end of a run raise ``RunInterrupted`` (and ignore
a second signal while unwinding); the training loop stops after the batch in flight (a
second Ctrl-C interrupts at once); multi-worker training first agrees with the other
workers. Each phase is a ``Phase`` entered as a context manager: while it is the innermost
one, its handlers answer, and on exit the enclosing phase answers again (or, after the
outermost one, whatever was installed before). Only this module calls ``signal.signal`` for
these two signals.

Why the record: ``train(cfg)`` turns a signal into a clean end of its session (an
interrupt checkpoint, exit 0) and returns, so its caller cannot tell an interrupted session
from a finished one by the return value. A Hydra multirun runs its jobs one after another
in one process; to stop the sweep instead of starting the next job,
``trainer.training.sweeps`` asks here (``take``) whether the job it just ran received a
signal (``record``).

Standard library only: train.py imports it before anything slow (TensorFlow, Hydra).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
Handler = Callable[[int, FrameType | None], Any]

_received: list[int] = []
_lock = threading.Lock()
_stack: list[Phase] = []  # entered phases, innermost last


def record(signum: int) -> None:
    """Note that ``signum`` was received (called from the signal handlers)."""
    with _lock:
        _received.append(int(signum))


def take() -> str | None:
    """The name of the first signal recorded since the last call (``"SIGTERM"``), or None;
    forgets them."""
    with _lock:
        received, _received[:] = list(_received), []
    return signal.Signals(received[0]).name if received else None


def _ignore(_signum: int, _frame: FrameType | None) -> None:
    """A phase's answer to a signal it must not act on (a second one while unwinding)."""


def _dispatch(signum: int, frame: FrameType | None) -> Any:
    """The handler installed while any phase is entered: the innermost phase answers."""
    if not _stack:  # only between the last exit and restoring the earlier handlers
        return None
    return _stack[-1].handlers[signum](signum, frame)


class Phase:
    """What SIGTERM and SIGINT do while this phase is the innermost entered one.

    ``handler`` answers both signals; ``on`` changes the answer to one of them from then
    on (a handler may call it: the first Ctrl-C asks for a stop, the second interrupts).
    Entering a phase outside the main thread does nothing (Python delivers signals to the
    main thread only, and refuses handlers from any other).
    """

    def __init__(self, name: str, handler: Handler):
        self.name = name
        self.handlers: dict[int, Handler] = {int(sig): handler for sig in SIGNALS}
        self.previous: dict[int, Any] | None = None  # installed when it was entered
        self.active = False

    def on(self, signum: int, handler: Handler) -> None:
        self.handlers[int(signum)] = handler

    def interrupt_at_once(self) -> None:
        """A further Ctrl-C raises ``KeyboardInterrupt`` wherever the program is."""
        self.on(signal.SIGINT, signal.default_int_handler)

    def ignore(self) -> None:
        """Further signals do nothing while this phase answers (its cleanup must finish)."""
        for sig in SIGNALS:
            self.on(sig, _ignore)

    def __enter__(self) -> Phase:
        if threading.current_thread() is not threading.main_thread():
            return self
        self.previous = {int(sig): signal.getsignal(sig) for sig in SIGNALS}
        _stack.append(self)
        self.active = True
        for sig in SIGNALS:
            signal.signal(sig, _dispatch)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.leave()

    def leave(self) -> None:
        """End this phase, and every phase entered inside it that is still on the stack;
        the handlers installed when it was entered answer again."""
        if not self.active:
            return
        # Handlers first: a signal in between still finds this phase on the stack.
        for sig, handler in (self.previous or {}).items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        index = _stack.index(self)
        for phase in _stack[index:]:
            phase.active = False
        del _stack[index:]

    def remove(self) -> None:
        """Take this phase off the stack although phases entered after it are still on it
        (start-up ends under the sweep's phase, see ``end_startup``): the phase above it
        then restores what this one would have on its exit."""
        if not self.active:
            return
        index = _stack.index(self)
        if index == len(_stack) - 1:
            self.leave()
            return
        _stack[index + 1].previous = self.previous
        del _stack[index]
        self.active = False


def current() -> str | None:
    """The name of the innermost entered phase (None: none is)."""
    return _stack[-1].name if _stack else None


# ------------------------------------------------------------------------------ start-up
STARTUP_MESSAGE = (
    "Received {name} during start-up, before the run began: nothing was run or written. "
    "Re-run the same command to start it."
)
_startup: dict[str, Any] = {}  # the start-up phase and the stderr it writes to


def begin_startup() -> Phase:
    """Enter the start-up phase (train.py's first statement): until ``end_startup``, a
    SIGTERM or Ctrl-C ends the process at once with one line on stderr and exit code 0, as
    at any later point. Without it the default actions applied while TensorFlow and Hydra
    were imported: killed by SIGTERM (exit code 143) or a ``KeyboardInterrupt`` traceback,
    with nothing said.

    It exits with ``os._exit``: nothing is written yet, and unwinding out of a half-done
    ``import tensorflow`` could hang in its threads or be swallowed by an import
    fallback. The line goes to a copy of the original stderr: during TensorFlow's import
    file descriptor 2 is a pipe to ``trainer.console``'s filter thread, which would not get
    to forward it."""
    if _startup.get("phase") is not None:
        return _startup["phase"]
    with contextlib.suppress(OSError):
        _startup["stderr"] = os.dup(2)
    phase = Phase("start-up", _exit_during_startup)
    _startup["phase"] = phase.__enter__()
    return phase


def end_startup() -> None:
    """Start-up is over: the phase entered after it (the sweep's) answers from now on, and
    the handlers from before start-up are back once that one ends."""
    phase = _startup.pop("phase", None)
    if phase is not None:
        phase.remove()
    stderr = _startup.pop("stderr", None)
    if stderr is not None:
        with contextlib.suppress(OSError):
            os.close(stderr)


def _exit_during_startup(signum: int, _frame: FrameType | None) -> None:
    line = STARTUP_MESSAGE.format(name=signal.Signals(signum).name) + "\n"
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: the line still goes
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(_startup.get("stderr", 2), line.encode())
    os._exit(0)
