"""What ``python train.py`` does around ``train(cfg)``: the job's return value, and errors.

Why: a deliberate error (a ``TrainerError`` such as ``ConfigMismatchError``, or a config
Hydra cannot compose or instantiate, such as ``data=npz`` without ``data.path``) is the
user's to fix, so it is one ``error: <message>`` line on stderr and exit code 2, like the
``trainer`` CLI. A traceback is shown only with ``HYDRA_FULL_ERROR=1``, or for an error
that is none of those (a bug: Python prints it, exit code 1).

``train.py`` stays a few lines: ``@hydra.main`` must decorate a function there (Hydra
finds ``conf/`` next to the calling file), and that function calls ``job``; its
``__main__`` block calls ``run(main)``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import trainer.training.config  # noqa: F401  (the schemas conf/ extends: registered before Hydra composes)
from trainer.errors import TrainerError
from trainer.training import interrupts, sweeps

EXIT_ERROR = 2  # the same code as the ``trainer`` CLI's ``error:`` lines
FULL_ERROR = "HYDRA_FULL_ERROR"


def job(cfg: DictConfig) -> float | None:
    """The body of train.py's ``@hydra.main`` function: train, return the objective."""
    from trainer.training.loop import train

    if _jobs_started:  # errors from here on are the job's, not Hydra's composing
        _jobs_started[-1] = True
    if sweeps.skip_job():  # a multirun stopped by a signal: no further job trains
        return None
    try:
        with _users_full_error():
            metrics = train(cfg)
        sweeps.after_job()
        return objective(metrics)
    except Exception as error:
        # Here rather than in ``run`` only: Hydra reports a failed job with a line of its
        # own ("Error executing job with overrides: ...") before re-raising its error.
        refuse(error)
        raise


def objective(metrics: Mapping[str, float]) -> float | None:
    """The value a Hydra sweeper optimises: the first final metric. None for a run
    interrupted before its first epoch ended (no metric yet; still a clean exit)."""
    return next(iter(metrics.values()), None)


def run(main: Callable[[], Any]) -> None:
    """Call train.py's ``@hydra.main`` function; a deliberate error ends the process
    with one ``error:`` line and exit code 2."""
    _users.append(os.environ.get(FULL_ERROR))
    _jobs_started.append(False)
    # Hydra then re-raises errors instead of printing its own report, so they reach us.
    os.environ[FULL_ERROR] = "1"
    try:
        with sweeps.watch():  # a signal during a multirun stops the sweep
            interrupts.end_startup()  # train.py's start-up phase: the sweep's answers now
            main()
    except Exception as error:  # raised while Hydra composed the config
        if not _jobs_started[-1] and deliberate_message(error) is None:
            # Hydra raises plain ValueErrors for some overrides it cannot apply
            # (`callbacks=null`: "Config group override must be a string or a list").
            error = HydraException(f"The config cannot be composed: {error}")
        refuse(error)
        raise
    finally:
        _restore(_users.pop())
        _jobs_started.pop()


def refuse(error: Exception) -> None:
    """Exit with ``error: <message>`` and code 2 if ``error`` is deliberate (unless the
    user asked for full tracebacks); return otherwise, for the caller to re-raise."""
    message = deliberate_message(error)
    users = _users[-1] if _users else os.environ.get(FULL_ERROR)
    if message is None or users == "1":  # Hydra's own test of the variable
        return
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_ERROR)


def deliberate_message(error: BaseException) -> str | None:
    """The one-line message of a deliberate error, or None for anything else (a bug)."""
    if isinstance(error, TrainerError):
        return one_line(str(error))
    if isinstance(error, InstantiationException):
        # A TrainerError raised while Hydra instantiated a config node (a loader refusing
        # its arguments) says more than Hydra's wrapper around it.
        cause = error.__cause__
        if isinstance(cause, TrainerError | OmegaConfBaseException):
            return one_line(str(cause))
    if isinstance(error, HydraException | OmegaConfBaseException):
        cause = error.__cause__
        extra = f" {cause}" if isinstance(cause, OmegaConfBaseException) else ""
        return one_line(f"{error}{extra}")
    return None


def one_line(message: str) -> str:
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


# The user's HYDRA_FULL_ERROR while ``run`` has set it (one entry per active ``run``).
_users: list[str | None] = []
# Whether the job of each active ``run`` started: an error before it is Hydra's.
_jobs_started: list[bool] = []


@contextlib.contextmanager
def _users_full_error() -> Iterator[None]:
    """While the job runs, the user's own ``HYDRA_FULL_ERROR`` (child processes inherit
    it); ``run``'s is back when Hydra looks at it, after the job."""
    if not _users:  # job() called without run()
        yield
        return
    ours = os.environ.get(FULL_ERROR)
    _restore(_users[-1])
    try:
        yield
    finally:
        _restore(ours)


def _restore(value: str | None) -> None:
    if value is None:
        os.environ.pop(FULL_ERROR, None)
    else:
        os.environ[FULL_ERROR] = value
