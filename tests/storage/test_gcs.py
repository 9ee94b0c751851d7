"""``gs://`` URLs (``trainer.storage.gcs``) against a real GCS emulator on 127.0.0.1
(fake-gcs-server, ``tests/helpers/gcs_server.py``), through the product's own path
(fsspec, gcsfs, Google's client): generation preconditions reach the server, every backend
saves and loads back, a second writer is refused, and a run stopped on the store resumes to
the weights of a run never stopped."""

from __future__ import annotations

import json
import sys
import time

import keras
import numpy as np
import pytest

from tests.helpers.config import compose_run
from tests.helpers.gcs_server import objects
from trainer import train
from trainer.checkpointing import CheckpointManager, all_variables
from trainer.errors import DirectoryInUseError, StoreError, UnsupportedLocationError
from trainer.save_backends import load_checkpoint
from trainer.storage import store
from trainer.storage.lease import LEASE
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.store import Store

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = (X.sum(axis=1) > 0).astype("int32")
RUN = ["model=mlp", "model.dropout=0.3", "save=weights", "checkpoint.policy.keep_last=2"]


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(2)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _variables(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for v in all_variables(model)]


def test_a_create_is_exclusive_and_a_replace_needs_the_generation_read(gcs_bucket):
    """``ifGenerationMatch`` reaches the server: a second create of a key is refused; a
    replace conditioned on a generation that is no longer current (a takeover in between,
    or a delete) writes nothing, and one on the current generation succeeds."""
    store = Store(f"{gcs_bucket}/ckpts")
    assert store.put_bytes(LEASE, b'{"token": "old"}', exclusive=True) is True
    assert store.put_bytes(LEASE, b'{"token": "second"}', exclusive=True) is False
    read, generation = store.get_versioned(LEASE)
    assert read == b'{"token": "old"}'
    store.put_bytes(LEASE, b'{"token": "taker"}')  # the takeover, in between
    assert store.put_bytes(LEASE, b'{"token": "old", "renewed": 1}', replacing=generation) is False
    assert store.get_bytes(LEASE) == b'{"token": "taker"}'
    _, current = store.get_versioned(LEASE)
    assert current != generation
    assert store.put_bytes(LEASE, b'{"token": "taker", "renewed": 1}', replacing=current)
    assert store.get_bytes(LEASE) == b'{"token": "taker", "renewed": 1}'
    _, latest = store.get_versioned(LEASE)
    store.delete([LEASE])
    assert store.put_bytes(LEASE, b"{}", replacing=latest) is False  # gone: not recreated
    assert store.get_bytes(LEASE) is None


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_save_to_gcs_and_load_back(gcs_bucket, gcs_server, tmp_path, backend):
    url = f"{gcs_bucket}/run/checkpoints"
    model = _model()
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    with CheckpointManager(url, backend, staging=tmp_path / "staging") as manager:
        saved = manager.save(model)
    assert str(saved).startswith(url + "/") and manager.latest() == saved
    name = str(saved).rsplit("/", 1)[1]
    keys = objects(gcs_server, url)
    assert f".commits/{name}.json" in keys and "latest" in keys and LEASE not in keys
    for source in (saved, f"{url}/latest"):
        loaded = load_checkpoint(source)
        assert loaded.state.global_step == 4
        for got, want in zip(_variables(loaded.model), _variables(model), strict=True):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(
            loaded.model.predict(X, verbose=0), model.predict(X, verbose=0)
        )


def test_a_second_writer_is_refused_while_the_first_holds_the_lease(
    gcs_bucket, gcs_server, tmp_path
):
    url = f"{gcs_bucket}/ckpts"
    model = _model()
    with CheckpointManager(url, "weights", staging=tmp_path / "first") as first:
        saved = first.save(model, wait=True)
        second = CheckpointManager(url, "weights", staging=tmp_path / "second")
        with pytest.raises(DirectoryInUseError, match="another writer holds its lease"):
            second.save(model, wait=True)
        second.close()
        assert first.all() == [saved]
        assert LEASE in objects(gcs_server, url)  # the first writer's, untouched


def test_another_machines_lease_refuses_a_run_before_training(compose_cfg, gcs_bucket):
    url = f"{gcs_bucket}/run"
    other = {"host": "other-machine", "pid": 4242, "token": "t", "expires": time.time() + 600}
    Store(f"{url}/checkpoints").put_bytes(LEASE, json.dumps(other).encode())
    with pytest.raises(DirectoryInUseError, match="PID 4242 on host other-machine"):
        train(compose_cfg(*RUN, f"run_dir={url}", "trainer.epochs=1"))
    assert json.loads(Store(f"{url}/checkpoints").get_bytes(LEASE)) == other


def test_a_run_stopped_on_gcs_resumes_to_the_weights_of_a_run_never_stopped(
    compose_cfg, gcs_bucket, tmp_path
):
    """Stopped by SIGTERM after step 4 of 6 and re-run with resume=auto, a run on gs://
    ends bitwise where the same run on disk, never stopped, ends."""
    train(compose_run(tmp_path / "straight", *RUN))
    expected = load_checkpoint(tmp_path / "straight" / "checkpoints" / "latest")
    url = f"{gcs_bucket}/broken"
    hook = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}"
    train(compose_cfg(*RUN, f"run_dir={url}", "resume=auto", hook))
    assert load_checkpoint(f"{url}/checkpoints/latest").state.global_step == 5
    train(compose_cfg(*RUN, f"run_dir={url}", "resume=auto"))
    actual = load_checkpoint(f"{url}/checkpoints/latest")
    assert actual.state.global_step == expected.state.global_step == 6
    for got, want in zip(_variables(actual.model), _variables(expected.model), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_missing_bucket_is_one_line_naming_it(gcs_bucket):
    with pytest.raises(StoreError) as error:
        RemoteCheckpoints("gs://no-such-bucket-here/run").committed()
    line = str(error.value)
    assert "\n" not in line
    assert "'no-such-bucket-here' of gs://no-such-bucket-here/run does not exist" in line
    assert "STORAGE_EMULATOR_HOST" in line


def test_a_gs_url_without_the_gcs_extra_names_the_install_command(monkeypatch):
    # As if not installed: the import fails (fsspec's, since fsspec keeps the gcsfs class it
    # has once imported).
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setattr(store, "_filesystems", {})
    with pytest.raises(UnsupportedLocationError) as error:
        Store("gs://bucket/x")
    assert 'pip install "trainer[gcs]"' in str(error.value)
