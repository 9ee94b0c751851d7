"""One writer per checkpoint directory on object storage (``trainer.storage.lease``),
through real ``CheckpointManager`` saves against a real S3-compatible server on 127.0.0.1
(``tests/helpers/s3_server.py``): a second writer is refused while the first one's lease
is live, an expired lease is taken over (and its old holder then stops), closing releases
it, and the lease object never lists as a checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.helpers.s3_server import objects
from tests.helpers.train_py import HANG_GUARD
from trainer.checkpointing import CheckpointManager
from trainer.errors import ConfigError, DirectoryInUseError
from trainer.save_backends import load_checkpoint
from trainer.state import TrainingState
from trainer.storage.lease import ENV, LEASE, lease_seconds
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.store import Store


@pytest.fixture(scope="module")
def model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _manager(url: str, tmp_path, label: str) -> CheckpointManager:
    return CheckpointManager(url, "weights", staging=tmp_path / label)


def _save(manager: CheckpointManager, model: keras.Model, step: int) -> str:
    return manager.save(model, TrainingState(global_step=step), wait=True)


def _lease(s3_server, url: str) -> dict:
    root = url[len("s3://") :]
    return json.loads(s3_server.fs.cat_file(f"{root}/{LEASE}"))


def test_a_second_writer_is_refused_while_the_first_lease_is_live(
    s3_bucket, s3_server, tmp_path, model
):
    url = f"{s3_bucket}/run/checkpoints"
    first = _manager(url, tmp_path, "one")
    saved = _save(first, model, 1)
    holder = _lease(s3_server, url)
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    assert holder["expires"] > time.time() + 500  # the 600 s default
    before = objects(s3_server, url)
    second = _manager(url, tmp_path, "two")
    assert second.all() == [saved]  # reading needs no lease
    with pytest.raises(DirectoryInUseError) as refused:
        _save(second, model, 2)
    message = str(refused.value)
    assert f"PID {os.getpid()} on host {socket.gethostname()}" in message
    assert "valid until" in message and ENV in message
    assert message.endswith(f"Received: '{url}/{LEASE}'")
    assert objects(s3_server, url) == before  # the refused writer wrote nothing
    assert _lease(s3_server, url)["token"] == holder["token"]
    with pytest.raises(DirectoryInUseError):  # setting aside is writing too
        second.set_aside_after(0)
    assert second.all() == [saved]
    _save(first, model, 3)  # the holder renews and carries on
    assert _lease(s3_server, url)["expires"] >= holder["expires"]
    first.close()


def test_an_expired_lease_is_taken_over_and_its_old_holder_stops(
    s3_bucket, s3_server, tmp_path, model, monkeypatch
):
    monkeypatch.setenv(ENV, "1")
    url = f"{s3_bucket}/ckpts"
    first = _manager(url, tmp_path, "one")
    _save(first, model, 1)
    # Stands in for a holder stalled longer than its lease (SIGSTOP, a frozen machine): its
    # background renewal does not run.
    first.lease._stop_renewing()
    expires = _lease(s3_server, url)["expires"]
    time.sleep(max(0.0, expires - time.time()) + 0.1)  # <= 1.1 s: nothing renewed it
    second = _manager(url, tmp_path, "two")
    taken = _save(second, model, 2)
    assert _lease(s3_server, url)["expires"] > expires
    assert load_checkpoint(taken).state.global_step == 2
    with pytest.raises(DirectoryInUseError, match="expired and was taken over"):
        _save(first, model, 3)
    first.close()  # releases nothing: the lease is no longer its own
    assert LEASE in objects(s3_server, url)
    second.close()
    assert LEASE not in objects(s3_server, url)
    assert [m["step"] for m in RemoteCheckpoints(url).committed()] == [1, 2]


def test_a_live_writer_that_saves_rarely_keeps_its_lease(
    s3_bucket, s3_server, tmp_path, model, monkeypatch
):
    """Between saves the lease is renewed in the background: a run whose saves are further
    apart than the lease's lifetime is not taken over while alive."""
    monkeypatch.setenv(ENV, "8")
    url = f"{s3_bucket}/ckpts"
    first = _manager(url, tmp_path, "one")
    _save(first, model, 1)
    held = _lease(s3_server, url)
    deadline = time.time() + HANG_GUARD
    while time.time() <= held["expires"] + 1:  # past the expiry of the last save's lease
        assert time.time() < deadline
        time.sleep(0.5)
    renewed = _lease(s3_server, url)
    assert renewed["token"] == held["token"] and renewed["expires"] > held["expires"]
    second = _manager(url, tmp_path, "two")
    with pytest.raises(DirectoryInUseError, match="another writer holds its lease"):
        _save(second, model, 2)
    _save(first, model, 3)  # still its own
    first.close()
    assert LEASE not in objects(s3_server, url)  # the renewal stopped with the release


def test_a_renewal_never_overwrites_a_takeover(s3_bucket, s3_server):
    """The renewal's write is conditional on the lease being unchanged since it was read
    (``If-Match``): a takeover landing between the read and the write wins."""
    store = Store(f"{s3_bucket}/ckpts")
    store.put_bytes(LEASE, b'{"token": "old"}')
    read, etag = store.get_versioned(LEASE)
    assert read == b'{"token": "old"}'
    store.put_bytes(LEASE, b'{"token": "taker"}')  # the takeover, in between
    assert store.put_bytes(LEASE, b'{"token": "old", "renewed": 1}', replacing=etag) is False
    assert store.get_bytes(LEASE) == b'{"token": "taker"}'
    _, current = store.get_versioned(LEASE)
    assert store.put_bytes(LEASE, b'{"token": "taker", "renewed": 1}', replacing=current)
    store.delete([LEASE])
    assert store.put_bytes(LEASE, b"{}", replacing=current) is False  # gone: not recreated
    assert store.get_bytes(LEASE) is None


def test_closing_releases_the_lease_for_the_next_writer(s3_bucket, s3_server, tmp_path, model):
    url = f"{s3_bucket}/ckpts"
    with _manager(url, tmp_path, "one") as first:
        _save(first, model, 1)
        assert LEASE in objects(s3_server, url)
    assert LEASE not in objects(s3_server, url)
    with _manager(url, tmp_path, "two") as second:  # no wait for any expiry
        assert str(_save(second, model, 2)).endswith("step-00000002")


def test_a_holder_whose_lease_was_deleted_creates_it_again(s3_bucket, s3_server, tmp_path, model):
    url = f"{s3_bucket}/ckpts"
    with _manager(url, tmp_path, "one") as manager:
        _save(manager, model, 1)
        token = _lease(s3_server, url)["token"]
        s3_server.fs.rm_file(f"{url[len('s3://') :]}/{LEASE}")
        _save(manager, model, 2)  # no other writer took it: the holder carries on
        assert _lease(s3_server, url)["token"] == token


def test_a_dead_holder_on_this_host_is_taken_over_at_once(s3_bucket, s3_server, tmp_path, model):
    """A job SIGKILLed and restarted on the same machine need not wait out the expiry."""
    url = f"{s3_bucket}/ckpts"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = {"host": socket.gethostname(), "pid": int(gone.stdout), "token": "x",
            "expires": time.time() + 3600}  # fmt: skip
    Store(url).put_bytes(LEASE, json.dumps(dead).encode())
    with _manager(url, tmp_path, "again") as manager:
        _save(manager, model, 1)
        assert _lease(s3_server, url)["pid"] == os.getpid()


def test_the_lease_is_never_a_checkpoint(s3_bucket, s3_server, tmp_path, model):
    url = f"{s3_bucket}/ckpts"
    manager = _manager(url, tmp_path, "one")
    saved = _save(manager, model, 1)
    assert LEASE in objects(s3_server, url)
    assert manager.all() == [saved] and manager.latest() == saved
    remote = RemoteCheckpoints(url)
    assert [m["name"] for m in remote.committed()] == ["step-00000001"]
    assert remote.read_latest() == "step-00000001"
    np.testing.assert_array_equal(
        load_checkpoint(f"{url}/latest").model.get_weights()[0], model.get_weights()[0]
    )
    manager.close()


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf"])
def test_a_bad_lease_expiry_is_refused(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError, match=f"{ENV} must be a positive number.*Received: '{value}'"):
        lease_seconds()
