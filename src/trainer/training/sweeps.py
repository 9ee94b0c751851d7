"""A SIGTERM/SIGINT during a Hydra multirun stops the sweep, not only the current job.

Why: Hydra's basic launcher runs a sweep's jobs one after another in one process, and
``train(cfg)`` turns a signal into a clean end of its session (interrupt checkpoint, exit
0) and returns, so Hydra went on to the next job and the sweep exited 0 as if complete. A
preempted machine must stop: here the interrupted job marks the sweep stopped, every later
job returns at once without training, and at the end one line names the jobs that did not
run and the command that continues the sweep in place (``hydra.sweep.dir=<same>
resume=auto``: finished jobs only complete missing end-of-run steps, the interrupted job
resumes from its checkpoint, the others start).

A signal between jobs (while Hydra sets the next one up) is caught by ``watch``'s phase of
``trainer.training.interrupts``; the training session's own phases record theirs there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from trainer.training import interrupts

log = logging.getLogger(__name__)

# Overrides the continue command sets itself.
REPLACED_KEYS = ("resume", "resume_dir", "hydra.sweep.dir")


@dataclasses.dataclass
class _Sweep:
    pending: str | None = None  # a signal received outside any training session
    signal: str | None = None  # the signal that stopped the sweep
    interrupted: tuple[int, list[str]] | None = None  # (job number, overrides)
    skipped: list[tuple[int, list[str]]] = dataclasses.field(default_factory=list)
    sweep_dir: Path | None = None


_state = _Sweep()


@contextlib.contextmanager
def watch() -> Iterator[None]:
    """Around the whole of ``python train.py``: a signal outside a training session is
    remembered (not fatal) and stops the sweep; a stopped sweep is reported at the end."""
    global _state
    _state = _Sweep()

    def remember(signum, _frame):
        name = signal.Signals(signum).name
        log.warning("Received %s outside a training session: no further job starts", name)
        _state.pending = _state.pending or name

    try:
        with interrupts.Phase("sweep", remember):
            yield
    finally:
        report()


def skip_job() -> bool:
    """Call first in a job: True (logged) when it must not run, because the sweep was
    stopped or a signal came before it started."""
    interrupts.take()  # stale records of sessions run outside ``job`` (in-process use)
    if _state.pending and _state.signal is None:
        if not in_multirun():
            log.warning(
                "Received %s before the run started; nothing was run. Re-run the same command "
                "to start it.",
                _state.pending,
            )
            return True
        _stop(_state.pending, None)
    if _state.signal is None:
        return False
    num, overrides = current_job()
    _state.skipped.append((num, overrides))
    log.warning(
        "Not running job #%d (%s): the sweep was stopped by %s",
        num,
        " ".join(overrides) or "no overrides",
        _state.signal,
    )
    return True


def after_job() -> None:
    """Call when a job's training returned: a signal it received stops the sweep."""
    received = interrupts.take() or _state.pending
    if received and in_multirun() and _state.signal is None:
        _stop(received, current_job())


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def current_job() -> tuple[int, list[str]]:
    """This job's number and the overrides that tell it from the sweep's other jobs (the
    swept keys; every override if the command line cannot be parsed)."""
    hydra_cfg = HydraConfig.get()
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    swept = swept_keys(sys.argv[1:])
    own = [o for o in overrides if _key(o) in swept]
    return int(hydra_cfg.job.num), own or overrides


def swept_keys(argv: list[str]) -> set[str]:
    """The keys the command line sweeps over (``seed=0,1,2``, ``x=range(3)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if a[:1] != "-"])
    except Exception:  # Hydra reported it already; the log line then lists every override
        return set()
    return {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _stop(name: str, job: tuple[int, list[str]] | None) -> None:
    _state.signal, _state.interrupted = name, job
    _state.sweep_dir = Path(str(HydraConfig.get().sweep.dir)).absolute()


def report() -> None:
    """The jobs that did not run, and the command that continues the sweep."""
    if _state.signal is None:
        return
    where = (
        f"during job #{_state.interrupted[0]} ({' '.join(_state.interrupted[1])})"
        if _state.interrupted
        else "between jobs"
    )
    skipped = ", ".join(f"#{n} ({' '.join(o)})" for n, o in _state.skipped) or "none"
    log.warning(
        "Sweep stopped by %s %s; jobs not run: %s. Continue the sweep in place (finished jobs "
        "only complete missing end-of-run steps, an interrupted one resumes from its "
        "checkpoint, the rest start) with: %s",
        _state.signal,
        where,
        skipped,
        continue_command(sys.argv[1:], _state.sweep_dir),
    )


def continue_command(argv: list[str], sweep_dir: Path | None) -> str:
    """This process's command line with the sweep directory fixed and ``resume=auto``."""
    kept = [a for a in argv if _key(a) not in REPLACED_KEYS]
    extra = [f"hydra.sweep.dir={os.fspath(sweep_dir)}"] if sweep_dir is not None else []
    return shlex.join(["python", "train.py", *kept, *extra, "resume=auto"])
