"""Two-worker ``strategy=multiworker`` runs of ``train.py`` on 127.0.0.1 for the tests:
one ``TF_CONFIG`` per process, a log file per worker and phase, and a hard stop."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.helpers import warm
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (all bound at once, then released)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for each in sockets:
            each.bind(("127.0.0.1", 0))
        return [each.getsockname()[1] for each in sockets]


def start_workers(
    overrides: list[str],
    tmp_path: Path,
    phase: str,
    only_worker1: tuple[str, ...] = (),
    env_of: Callable[[int], dict[str, str]] | None = None,
) -> list:
    """Two `python train.py strategy=multiworker ...` processes, one TF_CONFIG each;
    ``env_of(index)``: more environment for worker ``index`` (a machine of its own)."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    workers = []
    for index in range(2):
        env = subprocess_env()
        task = {"type": "worker", "index": index}
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
        env.update(env_of(index) if env_of else {})
        command = [
            sys.executable, str(ROOT / "train.py"), "strategy=multiworker", *overrides,
            f"hydra.run.dir={tmp_path / f'hydra-{phase}-{index}'}",
            *(only_worker1 if index == 1 else ()),
        ]  # fmt: skip
        with open(tmp_path / f"{phase}-worker{index}.log", "w") as log:
            workers.append(
                warm.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    return workers


def worker_log(tmp_path: Path, phase: str, index: int) -> str:
    return (tmp_path / f"{phase}-worker{index}.log").read_text()


def worker_logs(tmp_path: Path, phase: str) -> str:
    return "\n".join(
        f"--- worker {i}:\n" + worker_log(tmp_path, phase, i)[-3000:] for i in range(2)
    )


def kill(workers: list) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=30)
