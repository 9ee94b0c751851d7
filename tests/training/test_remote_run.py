"""``train(cfg)`` / ``python train.py`` with ``run_dir=s3://...``: checkpoints on a real
S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server``), the rest in a local
mirror; ``resume=auto`` continues from the store."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import pytest

from tests.helpers.config import compose_run
from tests.helpers.s3_server import bucket_env, objects
from tests.helpers.train_py import TINY_ARGS, train_py
from trainer import train
from trainer.checkpointing import all_variables
from trainer.errors import ConfigError, DirectoryInUseError, UnsupportedLocationError
from trainer.save_backends import load_checkpoint
from trainer.storage.lease import LEASE
from trainer.storage.store import Store
from trainer.training.remote_run import mirror_dir

RUN = ["model=mlp", "model.dropout=0.3", "save=weights", "checkpoint.policy.keep_last=2"]


def _final(url: str):
    checkpoint = load_checkpoint(f"{url}/checkpoints/latest")
    return [np.asarray(v) for v in all_variables(checkpoint.model)], checkpoint.state


@pytest.fixture(scope="module")
def never_stopped(s3_server, tmp_path_factory):
    """The final variables and state of the run never stopped, trained once for the
    module (with the weights backend: the backend changes what is written, not how the
    model trains, which the tests below check by comparing every backend's resumed run
    with this one)."""
    tmp = tmp_path_factory.mktemp("never-stopped")
    with bucket_env(s3_server, tmp / "store-cache") as bucket:
        url = f"{bucket}/straight"
        train(compose_run(tmp / "run", *RUN, f"run_dir={url}"))
        return _final(url)


def test_interrupted_run_on_the_store_resumes_to_the_same_weights(
    compose_cfg, s3_bucket, s3_server, never_stopped
):
    """Stopped by SIGTERM after step 4 of 6 and re-run with resume=auto (the command a
    preempted job repeats), the run ends where a run never stopped ends."""
    expected, expected_state = never_stopped
    broken = f"{s3_bucket}/broken"
    hook = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}"
    train(compose_cfg(*RUN, f"run_dir={broken}", "resume=auto", hook))
    assert _final(broken)[1].global_step == 5  # stopped after the batch in flight
    # The stopped session's TensorBoard log is on the store, up to where it stopped.
    mirror = mirror_dir(broken)
    logged = sorted(p for p in (mirror / "tb").rglob("*tfevents*") if p.is_file())
    assert logged
    for path in logged:
        key = path.relative_to(mirror).as_posix()
        assert s3_server.fs.cat_file(f"{broken[5:]}/{key}") == path.read_bytes(), key
    train(compose_cfg(*RUN, f"run_dir={broken}", "resume=auto"))
    actual, actual_state = _final(broken)
    assert actual_state.global_step == expected_state.global_step == 6
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    keys = objects(s3_server, f"{broken}/checkpoints")
    assert len([k for k in keys if k.startswith(".commits/")]) == 2  # keep_last=2, on the store


@pytest.mark.parametrize("backend", ["savedmodel", "h5"])
def test_a_run_stopped_at_random_on_the_store_resumes_bitwise_with_every_backend(
    compose_cfg, s3_bucket, never_stopped, backend
):
    """Stopped by SIGTERM after a random step (the seed is printed, and
    ``TRAINER_KILL_SEED`` replays it) and re-run with resume=auto, a run saving with
    ``backend`` ends bitwise where the run never stopped ends (the weights backend's run
    is the test above)."""
    seed = int(os.environ.get("TRAINER_KILL_SEED") or random.randrange(2**32))
    step = random.Random(seed).randint(1, 5)  # of the 6 steps
    print(f"TRAINER_KILL_SEED={seed}: SIGTERM after step {step}")
    url = f"{s3_bucket}/{backend}"
    run = [*RUN, f"save={backend}", f"run_dir={url}", "resume=auto"]
    hook = f"+callbacks.sigterm={{_target_: faults.SignalAtStep, step: {step}}}"
    train(compose_cfg(*run, hook))
    stopped = load_checkpoint(f"{url}/checkpoints/latest")
    # Stopped after the batch in flight, or at the step itself at an epoch's end.
    assert step <= stopped.state.global_step <= min(step + 1, 6), (seed, stopped.state)
    assert stopped.metadata["backend"] == backend, (seed, stopped.metadata["backend"])
    train(compose_cfg(*run))
    actual, actual_state = _final(url)
    expected, expected_state = never_stopped
    assert actual_state.global_step == expected_state.global_step == 6, seed
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=f"TRAINER_KILL_SEED={seed}")


def test_a_fresh_run_over_a_run_on_the_store_is_refused(compose_cfg, s3_bucket):
    url = f"{s3_bucket}/run"
    train(compose_cfg(*RUN, f"run_dir={url}", "trainer.epochs=1"))
    with pytest.raises(ConfigError, match="already holds 1 checkpoint"):
        train(compose_cfg(*RUN, f"run_dir={url}", "trainer.epochs=1"))


def test_a_second_writer_of_a_run_on_the_store_is_refused_before_training(
    compose_cfg, s3_bucket, s3_server
):
    """Another machine's live writer holds the checkpoint directory's lease: ``train``
    stops with DirectoryInUseError before it trains or writes anything there."""
    url = f"{s3_bucket}/run"
    other = {"host": "other-machine", "pid": 4242, "token": "t", "expires": time.time() + 600}
    Store(f"{url}/checkpoints").put_bytes(LEASE, json.dumps(other).encode())
    with pytest.raises(DirectoryInUseError, match="PID 4242 on host other-machine"):
        train(compose_cfg(*RUN, f"run_dir={url}", "trainer.epochs=1"))
    assert objects(s3_server, f"{url}/checkpoints") == [LEASE]
    assert json.loads(s3_server.fs.cat_file(f"{url[5:]}/checkpoints/{LEASE}")) == other


def test_resume_auto_skips_a_damaged_newest_checkpoint_on_the_store(
    compose_cfg, s3_bucket, s3_server
):
    """An object changed after its checkpoint was published fails that checkpoint's
    digest check: the run resumes from the one before, as from a damaged one on disk."""
    url = f"{s3_bucket}/run"
    every_step = [*RUN, "checkpoint.policy.every_n_steps=1", "trainer.epochs=1"]
    train(compose_cfg(*every_step, f"run_dir={url}"))
    newest = sorted(
        k for k in objects(s3_server, f"{url}/checkpoints") if k.startswith(".commits/")
    )
    name = newest[-1][len(".commits/") : -len(".json")]
    damaged = next(k for k in objects(s3_server, f"{url}/checkpoints") if k.startswith(name + "/"))
    s3_server.fs.pipe_file(f"{url[5:]}/checkpoints/{damaged}", b"changed")
    train(compose_cfg(*every_step, f"run_dir={url}", "resume=auto"))
    assert load_checkpoint(f"{url}/checkpoints/latest").state.global_step == 3


def test_an_unknown_scheme_is_refused_before_anything_is_written(compose_cfg, tmp_path):
    with pytest.raises(UnsupportedLocationError, match="az:// is not supported"):
        train(compose_cfg(*RUN, "run_dir=az://bucket/run", "resume=auto"))


def test_train_py_on_a_missing_bucket_is_one_error_line_and_exit_2(s3_bucket, tmp_path):
    proc = train_py(*TINY_ARGS, "run_dir=s3://no-such-bucket-y/run", "resume=auto", cwd=tmp_path)
    assert proc.returncode == 2, proc.output
    errors = [line for line in proc.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bucket 'no-such-bucket-y'" in errors[0], proc.output
    assert not (tmp_path / "s3:").exists()
