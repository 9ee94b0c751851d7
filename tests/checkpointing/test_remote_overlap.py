"""A save to object storage writes its intent record while the backend still writes the
local copy (``RemoteCheckpoints.begin``), and a local write that fails leaves the store as
it was: no intent record, an earlier checkpoint of the same name whole."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest

from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.errors import SaveError
from trainer.save_backends import load_checkpoint
from trainer.save_backends.base import SaveBackend
from trainer.state import TrainingState
from trainer.storage.early import EarlyUploads
from trainer.storage.store import Store

SYNC = CheckpointPolicy(async_save=False, name="ckpt-{step}")


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("sgd", "mse")
    return model


def test_the_intent_record_is_written_during_the_local_write(s3_bucket, tmp_path, monkeypatch):
    """The local write is held until the intent record's PUT has been seen; only a save
    that starts its store requests alongside the write gets there before the write ends."""
    started, recorded, finished = threading.Event(), threading.Event(), threading.Event()
    seen = []
    real_save, real_put = SaveBackend.save, Store.put_bytes

    def save(self, *args, **kwargs):
        started.set()
        recorded.wait(timeout=30)  # the record's PUT, if it comes during the write
        try:
            return real_save(self, *args, **kwargs)
        finally:
            finished.set()

    def put_bytes(self, relative, data, **kwargs):
        if relative.startswith(".pending/") and data == b"publish":
            seen.append(started.wait(timeout=30) and not finished.is_set())
            recorded.set()
        return real_put(self, relative, data, **kwargs)

    monkeypatch.setattr(SaveBackend, "save", save)
    monkeypatch.setattr(Store, "put_bytes", put_bytes)
    url = f"{s3_bucket}/run/checkpoints"
    model = _model()
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "staging") as manager:
        saved = manager.save(model, TrainingState(global_step=1), wait=True)
    assert seen == [True]
    assert not [k for k in objects_of(url) if k.startswith(".pending/")]
    x = np.ones((2, 4), "float32")
    np.testing.assert_allclose(
        load_checkpoint(saved).model.predict(x, verbose=0), model.predict(x, verbose=0)
    )


def objects_of(url: str) -> list[str]:
    return Store(url).walk("")


def test_a_failed_local_write_leaves_the_store_as_it_was(s3_bucket, tmp_path, monkeypatch):
    """A checkpoint ``ckpt-1`` is on the store; another writer's save of the same name
    fails while writing locally (after ``begin`` ran): ``ckpt-1`` is still listed and
    loads, and no intent record is left."""
    url = f"{s3_bucket}/run/checkpoints"
    model = _model()
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "a") as manager:
        first = manager.save(model, TrainingState(global_step=1), wait=True)
    before = objects_of(url)
    real_save = SaveBackend.save

    def save(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SaveBackend, "save", save)
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "b") as manager:
        with pytest.raises((SaveError, OSError)):
            manager.save(model, TrainingState(global_step=1), wait=True)
        assert manager.all() == [first]
    monkeypatch.setattr(SaveBackend, "save", real_save)
    assert objects_of(url) == before
    load_checkpoint(first)


# The variables' data file of a savedmodel checkpoint, which the backend finishes before
# the rest of the local write (``trace_cache.announce_variables``).
DATA = "variables/variables.data-00000-of-00001"


def _large_model() -> keras.Model:
    """12 MiB of variables with Adam's slots: above the sizes from which the savedmodel
    backend writes them with its own bundle writer, hashed on the way (8 MiB)."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024)])
    model.compile("adam", "mse")
    x = np.ones((4, 1024), "float32")
    model.fit(x, np.zeros((4, 1024), "float32"), batch_size=4, epochs=1, verbose=0)
    return model


def _seal_after_early_object(monkeypatch, url: str, name: str, seen: list, fail: bool) -> None:
    """Hold the save in its last local step (the manifest, before the fsync and the
    rename) until ``<name>/variables/...data...`` is on the store (``seen`` gets whether it
    came); then go on, or fail as a full disk does (``fail``)."""
    real_seal = SaveBackend.seal

    def seal(self, tmp, known):
        if tmp.name.startswith(f".{name}.tmp-"):  # this checkpoint's temporary
            found = False
            for _ in range(300):
                if f"{name}/{DATA}" in objects_of(url):
                    found = True
                    break
                threading.Event().wait(0.1)
            seen.append(found)
            if fail:
                raise OSError(28, "No space left on device")
        return real_seal(self, tmp, known)

    monkeypatch.setattr(SaveBackend, "seal", seal)


def test_the_variables_upload_starts_during_the_local_write(s3_bucket, tmp_path, monkeypatch):
    """The data file is on the store before the local write ends (the save is held there
    until it is), the checkpoint is listed only once the save returns, and it loads with
    the digests the marker recorded."""
    url = f"{s3_bucket}/run/checkpoints"
    model = _large_model()
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "staging") as manager:
        manager.save(model, TrainingState(global_step=1), wait=True)  # traced
        seen: list[bool] = []
        listed = []
        real_seal = SaveBackend.seal

        def seal(self, tmp, known):
            listed.append(list(manager.all()))
            return real_seal(self, tmp, known)

        monkeypatch.setattr(SaveBackend, "seal", seal)
        _seal_after_early_object(monkeypatch, url, "ckpt-2", seen, fail=False)
        model.fit(np.ones((4, 1024), "float32"), np.ones((4, 1024), "float32"), verbose=0)
        saved = manager.save(model, TrainingState(global_step=2), wait=True)
        assert seen == [True]
        assert listed == [[f"{url}/ckpt-1"]]  # not listed while it was being written
        assert manager.all() == [f"{url}/ckpt-1", saved] == [*listed[0], f"{url}/ckpt-2"]
    assert not [k for k in objects_of(url) if k.startswith(".pending/")]
    x = np.ones((2, 1024), "float32")
    loaded = load_checkpoint(f"{url}/latest")  # fetched, every digest checked
    assert loaded.state.global_step == 2
    np.testing.assert_allclose(loaded.model.predict(x, verbose=0), model.predict(x, verbose=0))


def test_a_write_failing_after_the_early_upload_leaves_no_checkpoint(
    s3_bucket, tmp_path, monkeypatch
):
    """The local write fails (disk full) after the data file was uploaded: the save
    raises, nothing of ``ckpt-2`` is left on the store (no object, no intent record), and
    ``latest`` is still ``ckpt-1``."""
    url = f"{s3_bucket}/run/checkpoints"
    model = _large_model()
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "staging") as manager:
        first = manager.save(model, TrainingState(global_step=1), wait=True)
        seen: list[bool] = []
        _seal_after_early_object(monkeypatch, url, "ckpt-2", seen, fail=True)
        with pytest.raises(SaveError):
            manager.save(model, TrainingState(global_step=2), wait=True)
        assert seen == [True]  # it was uploaded before the write failed
        assert manager.all() == [first]
    keys = objects_of(url)
    assert not [k for k in keys if k.startswith(("ckpt-2", ".pending/"))], keys
    assert load_checkpoint(f"{url}/latest").state.global_step == 1


def test_an_earlier_checkpoint_of_the_same_name_is_never_uploaded_over_early(
    s3_bucket, tmp_path, monkeypatch
):
    """``ckpt-1`` is on the store; another writer's save of the same name finishes its
    data file and then fails: nothing was uploaded over the earlier one, which still
    loads with its own values."""
    url = f"{s3_bucket}/run/checkpoints"
    model = _large_model()
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "a") as manager:
        first = manager.save(model, TrainingState(global_step=1), wait=True)
    before = {k: Store(url).get_bytes(k) for k in objects_of(url) if k.startswith("ckpt-1/")}
    announced = threading.Event()
    real_upload = EarlyUploads._upload

    def upload(self, *args):
        try:
            return real_upload(self, *args)
        finally:
            announced.set()

    real_seal = SaveBackend.seal

    def seal(self, tmp, known):
        if not tmp.name.startswith(".ckpt-1.tmp-"):
            return real_seal(self, tmp, known)
        assert announced.wait(timeout=60)  # the early upload ran (and skipped the file)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EarlyUploads, "_upload", upload)
    monkeypatch.setattr(SaveBackend, "seal", seal)
    changed = _large_model()
    changed.fit(np.ones((4, 1024), "float32"), np.ones((4, 1024), "float32"), verbose=0)
    with CheckpointManager(url, "savedmodel", SYNC, staging=tmp_path / "b") as manager:
        with pytest.raises(SaveError):
            manager.save(changed, TrainingState(global_step=1), wait=True)
        assert first in manager.all()
    assert {k: Store(url).get_bytes(k) for k in before} == before
    x = np.ones((2, 1024), "float32")
    np.testing.assert_allclose(
        load_checkpoint(first).model.predict(x, verbose=0), model.predict(x, verbose=0)
    )
