"""A load from object storage rebuilds the model while the variables still download
(``trainer.storage.arrival``), and still hashes every byte once against the manifest."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import keras
import numpy as np
import pytest

from trainer._compat import tensorflow as tf_compat
from trainer.errors import IntegrityError
from trainer.model_state import kit
from trainer.save_backends import load_checkpoint
from trainer.save_backends.registry import get_backend
from trainer.save_backends.savedmodel.bundle import index_reader
from trainer.save_backends.savedmodel.load.revival import Reviver
from trainer.storage import integrity
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.store import Store

DATA = "variables/variables.data-00000-of-00001"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A savedmodel checkpoint whose variables data file (2.3 MiB) is large enough to be
    downloaded while the model is rebuilt (``integrity.DEFER_FROM``), and its outputs."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(768, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(768)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(4, 16)).astype("float32")
    path = Path(get_backend("savedmodel").checkpoint_path(tmp_path_factory.mktemp("sm") / "ck"))
    get_backend("savedmodel").save(model, path)
    assert (path / DATA).stat().st_size >= integrity.DEFER_FROM
    return path, x, model.predict(x, verbose=0)


def _publish(url: str, path: Path) -> RemoteCheckpoints:
    remote = RemoteCheckpoints(f"{url}/ckpts")
    remote.publish(path, step=1)
    remote.point_latest(path.name)
    return remote


def test_the_variables_download_overlaps_the_rebuild(saved, s3_bucket, monkeypatch):
    """The data file's download is held until the model's layers and variables are
    rebuilt: only a load that rebuilds without the data file gets there (the object graph
    it needs is read from the store by range)."""
    path, x, expected = saved
    remote = _publish(s3_bucket, path)
    rebuilt = threading.Event()
    seen = []
    real_get, real_revive = Store.get_files, Reviver.revive

    def get_files(self, pairs):
        if any(key.endswith(DATA) for key, _ in pairs):
            seen.append(rebuilt.wait(timeout=30))  # False: the rebuild waited for it
        return real_get(self, pairs)

    def revive(self, layer_id):
        model = real_revive(self, layer_id)
        if layer_id == 0:
            rebuilt.set()
        return model

    monkeypatch.setattr(Store, "get_files", get_files)
    monkeypatch.setattr(Reviver, "revive", revive)
    loaded = load_checkpoint(f"{remote.url}/latest")
    assert seen == [True]
    np.testing.assert_allclose(loaded.model.predict(x, verbose=0), expected, rtol=1e-6)


def test_the_model_is_compiled_before_its_values_are_awaited(saved, s3_bucket, monkeypatch):
    """The data file's download is held until the model is compiled (its optimizer
    built): only a load that assigns the stored values after the compile, not before,
    gets there; the outputs are still the saved ones."""
    path, x, expected = saved
    remote = _publish(s3_bucket, path)
    compiled = threading.Event()
    seen = []
    real_get, real_compile = Store.get_files, kit.compile_model

    def get_files(self, pairs):
        if any(key.endswith(DATA) for key, _ in pairs):
            seen.append(compiled.wait(timeout=20))  # False: the load waited for the file
        return real_get(self, pairs)

    def compile_model(model, *args, **kwargs):
        real_compile(model, *args, **kwargs)
        compiled.set()

    monkeypatch.setattr(Store, "get_files", get_files)
    monkeypatch.setattr(kit, "compile_model", compile_model)
    loaded = load_checkpoint(f"{remote.url}/latest")
    assert seen == [True]
    assert loaded.model.optimizer.built
    np.testing.assert_allclose(loaded.model.predict(x, verbose=0), expected, rtol=1e-6)


def test_a_fresh_download_is_hashed_once_and_a_cached_one_again(saved, s3_bucket, monkeypatch):
    """A fresh download is hashed once per file (against the marker, whose digests equal
    the manifest's); a load of the entry the cache kept hashes every file again."""
    path, x, expected = saved
    remote = _publish(s3_bucket, path)
    hashed: list[str] = []
    real = integrity.file_digest

    def file_digest(target):
        hashed.append(Path(target).name)
        return real(target)

    monkeypatch.setattr(integrity, "file_digest", file_digest)
    load_checkpoint(f"{remote.url}/latest")
    assert hashed.count(Path(DATA).name) == 1
    assert len(hashed) == len(set(hashed))  # every file once
    hashed.clear()
    again = load_checkpoint(f"{remote.url}/latest")
    assert hashed.count(Path(DATA).name) == 1
    np.testing.assert_allclose(again.model.predict(x, verbose=0), expected, rtol=1e-6)


@pytest.mark.parametrize("where", ["head", "graph", "tail"])
def test_a_damaged_variables_object_is_refused_while_overlapped(
    saved,
    s3_bucket,
    s3_server,
    where,
):
    """Bytes of the data object changed on the store after publication (same size; at
    its head, in the object graph read ahead, or at its tail): the load that
    rebuilds the model meanwhile raises the marker's IntegrityError, keeps no cache
    entry, and a load after the object is repaired succeeds."""
    path, x, expected = saved
    remote = _publish(s3_bucket, path)
    key = remote.store.key(f"{path.name}/{DATA}")
    good = (path / DATA).read_bytes()
    at = 0 if where == "head" else len(good) - 8
    if where == "graph":
        index = path / "variables" / "variables.index"
        at = index_reader.find_entry(index, tf_compat.OBJECT_GRAPH_KEY).offset + 20
    bad = good[:at] + b"damaged!" + good[at + 8 :]
    s3_server.fs.pipe_file(key, bad)
    with pytest.raises(IntegrityError, match="commit marker"):
        load_checkpoint(f"{remote.url}/latest")
    cache = Path(os.environ["TRAINER_STORE_CACHE"])
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []
    s3_server.fs.pipe_file(key, good)
    loaded = load_checkpoint(f"{remote.url}/latest")
    np.testing.assert_allclose(loaded.model.predict(x, verbose=0), expected, rtol=1e-6)


def test_bytes_read_ahead_must_match_the_verified_download(
    saved,
    s3_bucket,
    s3_server,
    monkeypatch,
):
    """The object graph read ahead by range came from a damaged object, repaired before
    the whole file was downloaded (which then matches the marker): the load is refused
    rather than built from bytes that were never checked."""
    path, _x, _expected = saved
    remote = _publish(s3_bucket, path)
    key = remote.store.key(f"{path.name}/{DATA}")
    good = (path / DATA).read_bytes()
    index = path / "variables" / "variables.index"
    at = index_reader.find_entry(index, tf_compat.OBJECT_GRAPH_KEY).offset + 20
    s3_server.fs.pipe_file(key, good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])
    real_get, real_range = Store.get_files, Store.get_range
    read_ahead = threading.Event()

    def get_range(self, relative, start, end):
        ahead = real_range(self, relative, start, end)  # the damaged bytes
        if relative.endswith(DATA):
            s3_server.fs.pipe_file(key, good)  # repaired between the two requests
            read_ahead.set()
        return ahead

    def get_files(self, pairs):
        if any(k.endswith(DATA) for k, _ in pairs):
            # The whole file is fetched after the read ahead, whichever thread gets here
            # first (else the damaged object itself reaches the marker check: another error).
            read_ahead.wait(timeout=120)
        return real_get(self, pairs)

    monkeypatch.setattr(Store, "get_range", get_range)
    monkeypatch.setattr(Store, "get_files", get_files)
    with pytest.raises(IntegrityError, match="ahead of the download"):
        load_checkpoint(f"{remote.url}/latest")


def test_a_weights_checkpoint_loads_while_its_weights_arrive(s3_bucket, tmp_path, monkeypatch):
    """The ``weights`` backend's large ``model.weights.h5`` (one of its ``read_late``
    files) is still downloading when the model is rebuilt, and the load gives the saved
    outputs."""
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(768), keras.layers.Dense(768), keras.layers.Dense(8)]
    model = keras.Sequential([keras.Input((16,)), *layers])
    model.compile(optimizer="sgd", loss="mse")
    backend = get_backend("weights")
    path = Path(backend.checkpoint_path(tmp_path / "ck"))
    backend.save(model, path)
    assert (path / "model.weights.h5").stat().st_size >= integrity.DEFER_FROM
    remote = _publish(s3_bucket, path)
    downloads = []
    real_get = Store.get_files

    def get_files(self, pairs):
        weights = any(str(local).endswith("model.weights.h5") for _, local in pairs)
        downloads.append((weights, threading.current_thread() is threading.main_thread()))
        return real_get(self, pairs)

    monkeypatch.setattr(Store, "get_files", get_files)
    loaded = load_checkpoint(f"{remote.url}/latest")
    # the weights in the download thread, the small objects in the loading thread
    assert sorted(downloads) == [(False, True), (True, False)]
    x = np.ones((3, 16), "float32")
    np.testing.assert_allclose(
        loaded.model.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


def test_a_range_read_after_the_download_ended_is_still_checked(saved, s3_bucket, s3_server):
    """The data file arrived and matched the marker before the load read its object
    graph ahead by range (the download starts first and may win), and the object was
    replaced since: those bytes are compared with the verified file as they are served,
    not left unchecked because the download's own comparison already ran."""
    path, _x, _expected = saved
    remote = _publish(s3_bucket, path)
    local, arrival = remote.fetch_for_load(path.name, lambda _: ("variables/variables.data-*",))
    arrival.wait()  # downloaded, checked against the marker, early ranges compared
    key = remote.store.key(f"{path.name}/{DATA}")
    good = (path / DATA).read_bytes()
    at = index_reader.find_entry(
        path / "variables" / "variables.index", tf_compat.OBJECT_GRAPH_KEY
    ).offset
    s3_server.fs.pipe_file(key, good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])
    with pytest.raises(IntegrityError, match="ahead of the download"):
        arrival.read_range(DATA, at, 16)
    assert arrival.read_range("variables/variables.index", 0, 16) is None  # not pending
    assert (local / DATA).read_bytes() == good
