"""SIGTERM and SIGINT, phase by phase: the one stack of signal handlers, and the signal that
ended a training session.

Why one stack: a run passes through phases that each answer a signal differently. A sweep
remembers it and starts no further job; the set-up and the end of a run raise
``RunInterrupted`` (and ignore a second signal while unwinding); the training loop stops
after the batch in flight (a second Ctrl-C interrupts at once); multi-worker training first
agrees with the other workers. Each phase is a ``Phase`` entered as a context manager: while
it is the innermost one, its handlers answer, and on exit the enclosing phase answers again
(or, after the outermost one, whatever was installed before). Only this module calls
``signal.signal`` for these two signals.

Why the record: ``train(cfg)`` turns a signal into a clean end of its session (an
interrupt checkpoint, exit 0) and returns, so its caller cannot tell an interrupted session
from a finished one by the return value. A Hydra multirun runs its jobs one after another
in one process; to stop the sweep instead of starting the next job,
``trainer.training.sweeps`` asks here (``take``) whether the job it just ran received a
signal (``record``).

Standard library only: every layer may record one.
"""

from __future__ import annotations

import signal
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
        """Take this phase off the stack although phases entered after it are still on it:
        the phase above it then restores what this one would have on its exit."""
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
