"""The SIGTERM/SIGINT that ended a training session, for the code that runs sessions in a row.

Why: ``train(cfg)`` turns a signal into a clean end of its session (an interrupt checkpoint,
exit 0) and returns, so its caller cannot tell an interrupted session from a finished one by
the return value. A Hydra multirun runs its jobs one after another in one process; to stop
the sweep instead of starting the next job, ``trainer.training.entry`` asks here whether the job it
just ran received a signal. Standard library only: every layer may record one.
"""

from __future__ import annotations

import signal
import threading

_received: list[int] = []
_lock = threading.Lock()


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
