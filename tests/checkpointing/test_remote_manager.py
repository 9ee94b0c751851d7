"""``CheckpointManager``, ``load_checkpoint`` and the ``Checkpoint`` callback on an s3://
directory, against a real S3-compatible server on 127.0.0.1 (``tests/helpers/s3_server``):
every backend writes locally, uploads, publishes by its commit marker, and reads back
through the verified cache what a local save would have given."""

from __future__ import annotations

import signal
import sys

import keras
import numpy as np
import pytest

from tests.helpers import warm
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from tests.helpers.s3_server import objects
from tests.helpers.train_py import HANG_GUARD
from trainer.checkpointing import Checkpoint, CheckpointManager, CheckpointPolicy, all_variables
from trainer.errors import NotACheckpointError, StoreError
from trainer.save_backends import load_checkpoint
from trainer.storage.lease import LEASE
from trainer.storage.store import Store

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = (X.sum(axis=1) > 0).astype("int32")


def _model(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(2)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _same_variables(got: keras.Model, want: keras.Model) -> None:
    mine, theirs = all_variables(got), all_variables(want)
    assert len(mine) == len(theirs) > 4  # the optimizer's too
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_save_to_the_store_and_load_back(s3_bucket, s3_server, tmp_path, backend):
    url = f"{s3_bucket}/run/checkpoints"
    model = _model()
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    with CheckpointManager(url, backend, staging=tmp_path / "staging") as manager:
        saved = manager.save(model)
    assert saved == manager.saved[-1] and str(saved).startswith(url + "/")
    assert manager.all() == [saved] and manager.latest() == saved
    keys = objects(s3_server, url)
    name = str(saved).rsplit("/", 1)[1]
    assert f".commits/{name}.json" in keys and "latest" in keys
    for source in (saved, f"{url}/latest"):
        loaded = load_checkpoint(source)
        assert loaded.state.global_step == 4
        _same_variables(loaded.model, model)
        np.testing.assert_array_equal(
            loaded.model.predict(X, verbose=0), model.predict(X, verbose=0)
        )
        assert not str(loaded.path).startswith("s3:")  # read from the local cache


def test_retention_deletes_from_the_store(s3_bucket, s3_server, tmp_path):
    url = f"{s3_bucket}/ckpts"
    model = _model()
    policy = CheckpointPolicy(keep_last=1)
    with CheckpointManager(url, "weights", policy, staging=tmp_path / "staging") as manager:
        first = manager.save(model)
        model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
        second = manager.save(model)
        manager.wait()
        assert manager.all() == [second]
    first_name = str(first).rsplit("/", 1)[1]
    assert not any(
        key.startswith((first_name, f".commits/{first_name}")) for key in objects(s3_server, url)
    )
    with pytest.raises(NotACheckpointError, match="no commit marker"):
        load_checkpoint(first)


def test_callback_resumes_from_the_store_on_a_new_machine(s3_bucket, tmp_path):
    """A second fit with another (empty) staging directory, as on another machine,
    continues from the store: same weights as one uninterrupted fit (its model starts
    from other initial weights, which only the restore replaces)."""
    url = f"{s3_bucket}/ckpts"
    straight = _model()
    straight.fit(X, Y, epochs=2, batch_size=8, verbose=0, shuffle=False)

    model = _model()
    first = CheckpointManager(url, "weights", staging=tmp_path / "machine-1")
    model.fit(
        X,
        Y,
        epochs=1,
        batch_size=8,
        verbose=0,
        shuffle=False,
        callbacks=[Checkpoint(manager=first)],
    )
    resumed = _model(seed=2)
    second = CheckpointManager(url, "weights", staging=tmp_path / "machine-2")
    resumed.fit(
        X,
        Y,
        epochs=2,
        batch_size=8,
        verbose=0,
        shuffle=False,
        callbacks=[Checkpoint(manager=second)],
    )
    _same_variables(resumed, straight)


def test_a_missing_bucket_fails_when_the_manager_is_made(s3_bucket, tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        CheckpointManager("s3://no-such-bucket-x/run", "weights", staging=tmp_path)


def test_resuming_from_an_older_checkpoint_sets_the_later_ones_aside(
    s3_bucket, s3_server, tmp_path
):
    url = f"{s3_bucket}/ckpts"
    model = _model()
    with CheckpointManager(url, "weights", staging=tmp_path / "staging") as manager:
        first = manager.save(model)
        for _ in range(2):
            model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
            manager.save(model)
    manager = CheckpointManager(url, "weights", staging=tmp_path / "other")
    state = manager.restore(_model(), first).state
    folder = manager.set_aside_after(state.global_step)
    assert folder == f"{url}/abandoned-1"
    assert manager.all() == [first] and manager.latest() == first
    assert load_checkpoint(f"{url}/latest").state.global_step == 0
    keys = objects(s3_server, url)
    assert len([k for k in keys if k.startswith("abandoned-1/.commits/")]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("where", ["upload", "delete"])
def test_a_writer_killed_on_the_store_leaves_only_complete_checkpoints(
    s3_bucket, s3_server, tmp_path, where
):
    """SIGKILL after the first object of an upload, or right after retention deleted a
    marker: what lists is complete and loads; the leftovers have no marker; a new writer
    carries on over them."""
    url = f"{s3_bucket}/ckpts"
    child = ROOT / "tests" / "children" / "store_kill_child.py"
    proc = warm.run(
        [sys.executable, str(child), url, str(tmp_path / "staging"), where],
        env=subprocess_env(), capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    keys = objects(s3_server, url)
    markers = sorted(k for k in keys if k.startswith(".commits/"))
    assert markers == [
        ".commits/step-00000000.json" if where == "upload" else ".commits/step-00000001.json"
    ]
    leftover = "step-00000001/" if where == "upload" else "step-00000000/"
    assert any(k.startswith(leftover) for k in keys)  # objects without a marker
    complete = markers[0][len(".commits/") : -len(".json")]
    kept = {k: _read(s3_server, url, k) for k in keys if k.startswith((complete, markers[0]))}
    manager = CheckpointManager(url, "weights", staging=tmp_path / "again")
    assert [str(p).rsplit("/", 1)[1] for p in manager.all()] == [complete]
    assert any(k.startswith(leftover) for k in objects(s3_server, url))  # a reader cleans nothing
    manager.claim()  # the next writer takes the lease: the killed one's leftovers go
    keys = objects(s3_server, url)
    assert not [k for k in keys if k.startswith((leftover, ".pending/"))], keys
    assert {k: _read(s3_server, url, k) for k in kept} == kept  # the complete one untouched
    loaded = load_checkpoint(f"{url}/latest")
    assert loaded.state.global_step == (0 if where == "upload" else 1)
    manager.adopt(loaded.state)
    model = _model()
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    manager.save(model, wait=True)
    assert load_checkpoint(f"{url}/latest").state.global_step == 4


@pytest.mark.slow
def test_a_writer_killed_after_an_early_upload_leaves_objects_the_next_writer_removes(
    s3_bucket, s3_server, tmp_path
):
    """SIGKILL during a savedmodel save's local write, once its variables were uploaded
    early: the checkpoint is not listed (no marker), its intent record is there, and the
    next writer's lease removes its objects; the one before still loads."""
    url = f"{s3_bucket}/ckpts"
    child = ROOT / "tests" / "children" / "store_kill_child.py"
    proc = warm.run(
        [sys.executable, str(child), url, str(tmp_path / "staging"), "early"],
        env=subprocess_env(), capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    keys = objects(s3_server, url)
    assert sorted(k for k in keys if k.startswith(".commits/")) == [".commits/step-00000001.json"]
    assert "step-00000002/variables/variables.data-00000-of-00001" in keys
    assert ".pending/step-00000002" in keys
    manager = CheckpointManager(url, "savedmodel", staging=tmp_path / "again")
    assert [str(p).rsplit("/", 1)[1] for p in manager.all()] == ["step-00000001"]
    manager.claim()
    keys = objects(s3_server, url)
    manager.release()
    assert not [k for k in keys if k.startswith(("step-00000002", ".pending/"))], keys
    assert load_checkpoint(f"{url}/latest").state.global_step == 1


def _read(server, url: str, key: str) -> bytes:
    server.fs.invalidate_cache()  # s3fs would answer from its listing of before
    return server.fs.cat_file(f"{url[len('s3://') :]}/{key}")


def test_a_new_writer_cleans_only_recorded_names_without_a_marker(s3_bucket, s3_server, tmp_path):
    """A writer killed after its marker but before removing its intent record, objects
    no writer recorded, and a set-aside checkpoint's objects: taking the lease removes the
    record alone and touches none of them."""
    url = f"{s3_bucket}/ckpts"
    model = _model()
    with CheckpointManager(url, "weights", staging=tmp_path / "staging") as manager:
        name = str(manager.save(model, wait=True)).rsplit("/", 1)[1]
    store = Store(url)
    store.put_bytes(f".pending/{name}", b"publish")  # killed right after its marker
    store.put_bytes("notes/readme.txt", b"a user's object")
    store.put_bytes("abandoned-1/.commits/step-00000009.json", b"{}")
    store.put_bytes("step-00000009/model.weights.h5", b"set aside")
    before = {k: _read(s3_server, url, k) for k in objects(s3_server, url)}
    writer = CheckpointManager(url, "weights", staging=tmp_path / "other")
    writer.claim()
    after = {k: _read(s3_server, url, k) for k in objects(s3_server, url)}
    writer.release()
    assert set(before) - set(after) == {f".pending/{name}"}
    assert set(after) - set(before) == {LEASE}  # held by the new writer
    assert all(after[k] == before[k] for k in after if k != LEASE)
    assert load_checkpoint(f"{url}/latest").state.global_step == 0


def test_a_bucket_url_is_no_checkpoint(s3_bucket):
    with pytest.raises(NotACheckpointError, match="names a bucket") as error:
        load_checkpoint(s3_bucket)
    assert "\n" not in str(error.value)


def test_after_publish_runs_once_each_checkpoint_is_on_the_store(s3_bucket, tmp_path, caplog):
    """The hook a run on a store uploads its TensorBoard log with: called after each
    checkpoint's marker is on the store (it sees the checkpoint listed); a failing hook is
    a warning, the checkpoint stays published."""
    url = f"{s3_bucket}/run/checkpoints"
    model = _model()
    seen = []
    with CheckpointManager(url, "weights", staging=tmp_path / "staging") as manager:
        manager.after_publish.append(lambda: seen.append([str(p) for p in manager.all()]))
        manager.after_publish.append(lambda: 1 / 0)
        first = manager.save(model)
        manager.wait()
        model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
        second = manager.save(model)
    assert seen == [[str(first)], [str(first), str(second)]]
    assert "After publishing a checkpoint: division by zero" in caplog.text
