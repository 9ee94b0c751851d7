"""One writer per run directory, temporaries of live writers kept, readers' leases respected
by retention, deletes that never leave a half-deleted checkpoint under its real name
(issue 16 items 6 and 7, and the concurrent reader starved by retention)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import warm
from tests.helpers.checkpoints import list_checkpoints
from tests.helpers.config import TINY
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.errors import DirectoryInUseError
from trainer.save_backends import load_checkpoint
from trainer.storage.atomic import clean_stale_temporaries, temporary_sibling
from trainer.storage.locks import (
    LEASE_PREFIX,
    DirectoryLock,
    is_read,
    read_lease,
    remove_unless_read,
)

HOLDER = """
import sys
from trainer.storage.locks import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("held", flush=True)
sys.stdin.read()  # until the parent closes stdin or kills us
"""


@pytest.fixture
def other_process():
    """A live process other than this one (a Python child waiting on its stdin); with
    ``holding=DIR`` it holds ``DIR``'s lock."""
    children = []

    def start(holding=None):
        code = HOLDER if holding else "import sys; print('held', flush=True); sys.stdin.read()"
        child = subprocess.Popen(
            [sys.executable, "-c", code, *([str(holding)] if holding else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env(), text=True,
        )  # fmt: skip
        assert child.stdout.readline().strip() == "held"
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_a_second_writer_is_refused_until_the_first_dies(tmp_path, other_process):
    holder = other_process(holding=tmp_path)
    with pytest.raises(DirectoryInUseError, match=f"in use by PID {holder.pid} on host"):
        DirectoryLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock, nothing stale
    holder.wait()
    assert (tmp_path / ".trainer.lock").exists()  # left by the crash, not locked
    with DirectoryLock(tmp_path) as lock:
        assert lock.path.exists()
        with pytest.raises(DirectoryInUseError):  # held in this process too
            DirectoryLock(tmp_path).acquire()
    assert list(tmp_path.iterdir()) == []  # a clean release leaves nothing
    DirectoryLock(tmp_path).acquire().release()  # free again


def test_train_py_on_a_run_directory_in_use_is_refused_before_writing(tmp_path, other_process):
    run = tmp_path / "run"
    holder = other_process(holding=run)
    result = warm.run(
        [sys.executable, str(ROOT / "train.py"), *TINY, "model=mlp", f"hydra.run.dir={run}"],
        capture_output=True, text=True, env=subprocess_env(), check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert f"in use by PID {holder.pid}" in result.stderr + result.stdout
    written = sorted(p.name for p in run.iterdir())
    assert "checkpoints" not in written and "tb" not in written, written


def test_a_refused_train_py_leaves_the_runs_hydra_config_as_it_was(tmp_path, other_process):
    """Hydra writes .hydra/config.yaml before trainer can refuse a run in use: the refused
    process's config (seed 9) replaced the run's own, which `trainer runs` then read."""
    run = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), *TINY, "model=mlp", f"hydra.run.dir={run}"]
    first = warm.run(command, capture_output=True, text=True, env=subprocess_env())
    assert first.returncode == 0, first.stderr[-2000:]
    files = {
        name: (run / ".hydra" / name).read_text() for name in ("config.yaml", "overrides.yaml")
    }
    holder = other_process(holding=run)
    refused = warm.run(
        [*command, "seed=9", "resume=auto"], capture_output=True, text=True, env=subprocess_env()
    )
    assert refused.returncode == 2 and f"in use by PID {holder.pid}" in refused.stderr
    assert {name: (run / ".hydra" / name).read_text() for name in files} == files


def test_temporaries_of_a_live_writer_are_not_cleaned(tmp_path, other_process):
    writer = other_process()
    live = tmp_path / f".step-00000002.tmp-{writer.pid}-0123abcd"
    live.mkdir()
    (live / "weights.h5").write_bytes(b"in progress")
    mine = temporary_sibling(tmp_path / "step-00000001")  # this process: stale when cleaning
    mine.mkdir()
    assert clean_stale_temporaries(tmp_path) == [mine]
    assert live.exists()
    writer.kill()
    writer.wait()
    assert clean_stale_temporaries(tmp_path) == [live]


def small_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model, np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")


def test_retention_defers_a_checkpoint_a_reader_holds(tmp_path):
    model, x, y = small_model()
    directory = tmp_path / "ckpt"
    policy = CheckpointPolicy(keep_last=1, keep_best=0, async_save=False)
    manager = CheckpointManager(directory, backend="weights", policy=policy)
    model.fit(x, y, verbose=0)
    first = manager.save(model)
    with read_lease(first) as held:
        assert held and is_read(first)
        model.fit(x, y, verbose=0)
        second = manager.save(model)
        assert [p.name for p in list_checkpoints(directory)] == [first.name, second.name]
        assert load_checkpoint(first).state.global_step == 1  # whole, while leased
    assert not is_read(first) and not any(
        p.name.startswith(LEASE_PREFIX) for p in directory.iterdir()
    )
    model.fit(x, y, verbose=0)
    third = manager.save(model)  # the next pass removes what the lease kept
    assert [p.name for p in list_checkpoints(directory)] == [third.name]
    assert [r["name"] for r in manager.records] == [third.name]
    manager.close()


def test_a_lease_of_a_dead_reader_is_ignored_and_removed(tmp_path, other_process):
    model, x, y = small_model()
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(
        directory, backend="weights", policy=CheckpointPolicy(async_save=False)
    )
    model.fit(x, y, verbose=0)
    checkpoint = manager.save(model)
    reader = other_process()
    lease = directory / f"{LEASE_PREFIX}{checkpoint.name}.{reader.pid}-0123abcd"
    lease.write_text(os.uname().nodename)
    longer = directory / f"{LEASE_PREFIX}{checkpoint.name}-b.{reader.pid}-0123abcd"
    longer.write_text(os.uname().nodename)  # another checkpoint's lease: not this one's
    assert is_read(checkpoint)
    reader.kill()
    reader.wait()
    assert not is_read(checkpoint) and not lease.exists()
    assert remove_unless_read(checkpoint) and not checkpoint.exists()
    assert not any(p.name.startswith(".step") for p in directory.iterdir())  # no trash left


def test_unmanaged_directories_get_no_lease(tmp_path):
    model, x, y = small_model()
    model.fit(x, y, verbose=0)
    manager = CheckpointManager(
        tmp_path / "ckpt", backend="weights", policy=CheckpointPolicy(async_save=False)
    )
    path = manager.save(model)
    loose = tmp_path / path.name
    path.rename(loose)  # a copy outside a managed directory: nothing to defer, nothing written
    with read_lease(loose) as held:
        assert not held
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", loose.name])


def test_a_new_manager_removes_the_leases_of_dead_readers_only(tmp_path, other_process):
    """The newest checkpoint is never pruned, so retention never looked at its leases: a
    reader killed while reading it (a resume killed at start-up) left its lease for good."""
    model, x, y = small_model()
    directory = tmp_path / "ckpt"
    policy = CheckpointPolicy(async_save=False)
    manager = CheckpointManager(directory, backend="weights", policy=policy)
    model.fit(x, y, verbose=0)
    checkpoint = manager.save(model)
    dead, live = other_process(), other_process()
    host = os.uname().nodename
    leases = {}
    for name, reader in (("dead", dead), ("live", live)):
        leases[name] = directory / f"{LEASE_PREFIX}{checkpoint.name}.{reader.pid}-0123abcd"
        leases[name].write_text(host)
    elsewhere = directory / f"{LEASE_PREFIX}{checkpoint.name}.{dead.pid}-4567cdef"
    elsewhere.write_text("another-host")  # its PID means nothing here: kept
    dead.kill()
    dead.wait()
    CheckpointManager(directory, backend="weights", policy=policy)
    assert not leases["dead"].exists()
    assert leases["live"].exists() and elsewhere.exists()
