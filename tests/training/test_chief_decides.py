"""``strategy=multiworker`` with ``run_dir=s3://...``: two ``train.py`` worker processes on
127.0.0.1 against the real S3-compatible test server (``tests/helpers/s3_server``). Only
the chief writes to the store; the chief chooses the checkpoint to resume from and every
worker downloads that one into its own cache (``trainer.training.chief_decides``).

Each worker gets a cache directory of its own, fresh in every phase (``TRAINER_STORE_CACHE``;
the run's local mirror and staging sit next to it), as on machines without a shared
filesystem: what a resumed worker knows of the run comes from the store only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.distribute import BASE, assert_close, values
from tests.helpers.s3_server import objects
from tests.helpers.workers import kill, start_workers, worker_log, worker_logs
from trainer import train
from trainer.storage.lease import LEASE
from trainer.storage.remote import RemoteCheckpoints

WORKER_TIMEOUT = 900  # hang guard for a phase of two workers, never a speed check


def machines(tmp_path: Path, phase: str):
    """Each worker's own empty cache (and with it mirror and staging) for ``phase``."""
    return lambda index: {"TRAINER_STORE_CACHE": str(tmp_path / f"host-{phase}-{index}" / "c")}


def finish(workers, tmp_path: Path, phase: str) -> list[int]:
    try:
        for worker in workers:
            worker.wait(timeout=WORKER_TIMEOUT)
    finally:
        kill(workers)
    return [w.returncode for w in workers]


@pytest.mark.slow
def test_a_multiworker_run_on_the_store_killed_resumes_from_it(
    compose_cfg, s3_bucket, s3_server, tmp_path
):
    url = f"{s3_bucket}/run"
    config = [*BASE, "trainer.epochs=3", "checkpoint.policy.every_n_steps=1", "save=weights",
              f"run_dir={url}", "resume=auto"]  # fmt: skip

    # Every save sleeps 1 s before it is published, so that the SIGKILL of both workers
    # (no cleanup of any kind: the chief's lease and maybe a cut upload stay) lands mid-run.
    slow = ["save._target_=faults.slow_backend", "+save.delay=1.0"]
    first = start_workers([*config, *slow], tmp_path, "first", env_of=machines(tmp_path, "first"))
    remote = RemoteCheckpoints(f"{url}/checkpoints")
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT
        while not remote.committed() or remote.committed()[-1]["step"] < 3:
            crashed = [w.returncode for w in first if w.poll() is not None]
            assert not crashed, f"a worker exited: {crashed}\n{worker_logs(tmp_path, 'first')}"
            assert time.monotonic() < deadline, worker_logs(tmp_path, "first")
            time.sleep(0.2)
    finally:
        kill(first)
    chosen = remote.committed()[-1]
    assert 3 <= chosen["step"] < 9, worker_logs(tmp_path, "first")
    assert f"checkpoints/{LEASE}" in objects(s3_server, url)  # the killed chief's

    # Resumed on "other machines" (empty caches and mirrors), with the export on.
    resumed = start_workers(
        [*config, "export.enabled=true"], tmp_path, "resumed", env_of=machines(tmp_path, "resumed")
    )
    pids = [first[1].pid, resumed[1].pid]
    assert finish(resumed, tmp_path, "resumed") == [0, 0], worker_logs(tmp_path, "resumed")
    # Both resumed from the chief's newest checkpoint, each from its own download of it.
    for index in range(2):
        cache = tmp_path / f"host-resumed-{index}" / "c"
        assert [p.name for p in cache.glob(f"*/{chosen['name']}")] == [chosen["name"]], index
        resumed_from = f"/{chosen['name']} at epoch {chosen['epoch']}, step {chosen['step']}"
        assert resumed_from in worker_log(tmp_path, "resumed", index), index

    # The run never stopped (one device): the same weights, to the reduction order's rounding.
    single = tmp_path / "single"
    train(compose_cfg(*BASE, "trainer.epochs=3", "save=weights", f"run_dir={single}"))
    expected, expected_state = values(single / "checkpoints" / "latest")
    got, state = values(f"{url}/checkpoints/latest")
    assert state.global_step == expected_state.global_step == 9
    assert_close(got, expected)

    # Only the chief wrote to the store: no worker scratch, no event file of worker 1, one
    # export version, and no lease left behind.
    keys = objects(s3_server, url)
    assert not [k for k in keys if ".worker-" in k], keys
    assert not [k for k in keys if "tfevents" in k and any(f".{p}." in k for p in pids)], keys
    assert [k for k in keys if k.startswith("export/.commits/")] == ["export/.commits/1.json"]
    assert f"checkpoints/{LEASE}" not in keys


@pytest.mark.slow
def test_the_chiefs_refusal_stops_every_worker_with_one_line(s3_bucket, tmp_path):
    """resume=latest on a run with no checkpoint: the chief refuses, and worker 1, which
    never lists the store itself, stops with the chief's reason instead of waiting."""
    config = [*BASE, f"run_dir={s3_bucket}/empty", "resume=latest"]
    workers = start_workers(config, tmp_path, "refused", env_of=machines(tmp_path, "refused"))
    assert finish(workers, tmp_path, "refused") == [2, 2], worker_logs(tmp_path, "refused")
    for index in range(2):
        errors = [
            line
            for line in worker_log(tmp_path, "refused", index).splitlines()
            if line.startswith("error:")
        ]
        assert len(errors) == 1, worker_logs(tmp_path, "refused")
        assert "resume=latest found no complete checkpoint" in errors[0]
        assert ("Received from the chief" in errors[0]) == (index == 1)
