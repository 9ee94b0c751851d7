"""Multi-worker decisions taken by the chief alone and sent to every worker: which
checkpoint of a run on object storage they all resume from.

Why: every worker must restore the same checkpoint, or the replicas start from different
weights and data positions and the run is silently wrong. Workers listing the store on
their own could disagree (a newer checkpoint published or set aside between two listings,
a damaged download on one host only), so only the chief lists it and chooses; the others
never read ``latest`` or the listing. They receive the chosen name through one
all-reduce (the chief's bytes, zeros from everyone else: a broadcast built from the
strategy's public ``reduce``), then download exactly that checkpoint by its commit marker.
If the chief's choice fails (a refused fresh run, nothing to resume with
``resume=latest``, every checkpoint damaged), it sends the failure instead, and every
worker stops with one error line rather than waiting for the chief in a collective.
After the downloads, one more all-reduce tells every worker whether all of them got the
checkpoint; if one did not, all stop before training.

Outside ``strategy=multiworker`` (one process), ``decide`` simply runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from trainer.errors import PeerWorkerError

log = logging.getLogger(__name__)

LIMIT = 480  # bytes of a name or an error message sent (a message is cut there)
_NONE, _TEXT, _FAILED = 0, 1, 2


def chief_decides(dist, decide: Callable[[], str | None]) -> str | None:
    """``decide()`` run on the chief; its result (a name or None) on every worker. A
    failure of ``decide`` on the chief is re-raised there and reaches the other workers as
    ``PeerWorkerError`` carrying its message."""
    if not _multiworker(dist):
        return decide()
    if dist.is_chief:
        try:
            chosen = decide()
        except BaseException as error:
            _broadcast(dist, _FAILED, f"{type(error).__name__}: {error}")
            raise
        _broadcast(dist, _TEXT if chosen is not None else _NONE, chosen or "")
        return chosen
    status, text = _broadcast(dist, _NONE, "")
    if status == _FAILED:
        raise PeerWorkerError(
            f"The chief of this multi-worker run stopped before training, so this worker "
            f"(task {dist.task_type}:{dist.task_id}) stops too; fix what the chief's own "
            f"error says and re-run every worker. Received from the chief: {text}"
        )
    return text if status == _TEXT else None


def everyone_ready(dist, failure: BaseException | None) -> None:
    """After each worker did its part (``failure``: its own error, or None): raise on
    every worker if any of them failed; the failed one re-raises its own error."""
    if not _multiworker(dist):
        if failure is not None:
            raise failure
        return
    failed = _sum(dist, np.array([1.0 if failure is not None else 0.0], np.float32))[0]
    if failure is not None:
        raise failure
    if failed:
        raise PeerWorkerError(
            f"{int(failed)} other worker(s) of this multi-worker run could not get the "
            f"checkpoint the chief chose, so this worker (task {dist.task_type}:"
            f"{dist.task_id}) stops too before training; see their error lines. Received: "
            f"{int(failed)} worker(s) failed"
        )


def _multiworker(dist) -> bool:
    return dist is not None and dist.kind == "multiworker" and dist.strategy is not None


def _broadcast(dist, status: int, text: str) -> tuple[int, str]:
    """The chief's ``(status, text)`` on every worker: each of the chief's replicas adds
    ``[1, status, bytes...]``, every other replica zeros; the sum divided by its first
    element (the chief's replica count) is the chief's message."""
    data = text.encode()[:LIMIT]
    mine = np.zeros(2 + LIMIT, np.float32)
    if dist.is_chief:
        mine[0], mine[1] = 1.0, float(status)
        mine[2 : 2 + len(data)] = np.frombuffer(data, np.uint8)
    total = _sum(dist, mine)
    count = total[0]
    if count < 1:  # cannot happen with a chief in the cluster: say so rather than guess
        raise PeerWorkerError(
            f"No chief took part in the multi-worker agreement on the checkpoint to resume "
            f"from: check TF_CONFIG (one task of type chief, or worker 0). Received: "
            f"{count} chief replicas"
        )
    values = np.rint(total / count).astype(np.int64)
    raw = bytes(int(b) for b in values[2:] if b)
    return int(values[1]), raw.decode(errors="replace")


def _sum(dist, mine: np.ndarray) -> np.ndarray:
    """The element-wise sum over every replica of the cluster of each one's ``mine``
    (float32: bytes and small counts add up exactly)."""
    strategy = dist.strategy
    values = strategy.experimental_distribute_values_from_function(
        lambda _context: tf.constant(mine)
    )
    return np.asarray(strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None))
