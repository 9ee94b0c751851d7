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
