"""The drop-in ``trainer.callbacks.Checkpoint`` (issue 15, items 1, 2): the plain-Keras script
of docs/tutorials/keras-script.md, killed with SIGKILL and run again, ends with bitwise the
same weights, optimizer and RNG states as a run never stopped, for every backend; and
``CheckpointManager`` on its own."""

from __future__ import annotations

import signal
import sys

import keras
import numpy as np
import pytest

from tests.helpers import warm
from tests.helpers.paths import CHILDREN_DIR
from tests.helpers.processes import subprocess_env
from trainer.checkpointing import AsyncBackend, CheckpointManager, CheckpointPolicy
from trainer.errors import ConfigError, NotACheckpointError, SaveError
from trainer.save_backends import get_backend, read_checkpoint_metadata

CHILD = CHILDREN_DIR / "plain_keras_child.py"
TIMEOUT = 600  # hang guard only


def run_example(cwd, out, *args):
    cwd.mkdir(exist_ok=True)
    return warm.run(
        [sys.executable, str(CHILD), str(out), *args],
        cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The example run once, never stopped: every variable at the end."""
    where = tmp_path_factory.mktemp("straight")
    done = run_example(where, where / "final.npz")
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(where / "final.npz")


def assert_same(out, reference):
    got = np.load(out)
    assert len(got.files) == len(reference.files)
    for key in reference.files:
        np.testing.assert_array_equal(got[key], reference[key], err_msg=key)


def kill_and_rerun(tmp_path, kill_at, *replace):
    replacements = [a for pair in replace for a in ("--replace", *pair)]
    kill = ["--kill-at", str(kill_at)]
    killed = run_example(tmp_path, tmp_path / "unused.npz", *kill, *replacements)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    latest = read_checkpoint_metadata(tmp_path / "checkpoints" / "latest")["state"]
    again = run_example(tmp_path, tmp_path / "final.npz", *replacements)
    assert again.returncode == 0, again.stderr[-3000:]
    return latest


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_sigkill_and_rerun_ends_bitwise_like_a_run_never_stopped(tmp_path, reference, backend):
    """Killed in epoch 3 (13 steps per epoch), with the backend's default async writes: the
    newest save may be unfinished, and the rerun resumes from whichever one is complete."""
    latest = kill_and_rerun(tmp_path, 30, ('backend="weights"', f'backend="{backend}"'))
    assert 0 < latest["global_step"] <= 30
    assert_same(tmp_path / "final.npz", reference)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_resumes_exactly(tmp_path, reference):
    """h5 (synchronous saves) every 7 steps (13 per epoch): killed after step 44, the newest
    checkpoint is step 42, 3 batches into epoch 4; the rerun runs those 3 batches again,
    puts the checkpoint back and continues."""
    h5 = [('backend="weights"', 'backend="h5"'), ("every_n_steps=20)", "every_n_steps=7)")]
    latest = kill_and_rerun(tmp_path, 44, *h5)
    assert (latest["global_step"], latest["epoch"], latest["step_in_epoch"]) == (42, 3, 3)
    assert_same(tmp_path / "final.npz", reference)


def small_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    return model, x, y


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_manager_saves_lists_prunes_and_restores(tmp_path, backend):
    model, x, y = small_model()
    policy = CheckpointPolicy(keep_last=2, keep_best=0, async_save=True)
    with CheckpointManager(tmp_path / "ckpt", backend=backend, policy=policy) as manager:
        assert isinstance(manager.backend, AsyncBackend) and manager.latest() is None
        for _ in range(3):
            model.fit(x, y, epochs=1, verbose=0)
            manager.save(model)
        assert manager.save(model) is None  # this step is saved already
    names = [p.name for p in manager.all()]
    assert len(names) == 2 and names[-1].startswith("step-00000003")  # newest two kept
    assert manager.latest() == manager.all()[-1]
    expected = model.get_weights()
    fresh, _, _ = small_model()
    restored = CheckpointManager(tmp_path / "ckpt", backend=backend).restore(fresh)
    assert restored.model is fresh and restored.state.global_step == 3
    for got, want in zip(fresh.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(fresh.optimizer.iterations.numpy()) == 3
    loaded = CheckpointManager(tmp_path / "ckpt", backend=backend).restore()  # a new model
    np.testing.assert_array_equal(loaded.model.get_weights()[0], expected[0])


def test_manager_refuses_what_it_cannot_do(tmp_path):
    manager = CheckpointManager(tmp_path / "empty", backend=get_backend("h5"))
    with pytest.raises(NotACheckpointError, match="no complete checkpoint"):
        manager.restore()
    from trainer.callbacks import Checkpoint

    with pytest.raises(ConfigError, match="Unknown checkpoint option"):
        Checkpoint(tmp_path, keep_lastt=2)
    with pytest.raises(ConfigError, match="resume"):
        Checkpoint(tmp_path, resume="yes")


def test_compat_set_initial_epoch_moves_the_start_of_fit():
    """The one private hook the callback needs (``model._initial_epoch``): still honoured."""
    from trainer._compat.keras_training import set_initial_epoch

    model, x, y = small_model()

    class Start(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            set_initial_epoch(self.model, 2)

    history = model.fit(x, y, epochs=3, verbose=0, callbacks=[Start()])
    assert history.epoch == [2]
    set_initial_epoch(model, None)
    assert model.fit(x, y, epochs=2, verbose=0).epoch == [0, 1]


def test_async_backend_wraps_any_backend(tmp_path):
    """``AsyncBackend(inner)`` used directly: the write holds the state at the call, even
    when training moves on before it finishes; a failure surfaces at ``wait``."""
    from trainer.save_backends import load_checkpoint

    model, x, y = small_model()
    backend = AsyncBackend(get_backend("weights"))
    assert backend.name == "weights"  # everything else is the inner backend's
    expected = [w.copy() for w in model.get_weights()]
    path = backend.save(model, tmp_path / "ckpt")
    model.fit(x, y, epochs=1, verbose=0)  # changes the live weights during the write
    backend.wait()
    for got, want in zip(load_checkpoint(path).model.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    backend.save(model, tmp_path / ("x" * 300))  # a name the filesystem refuses
    with pytest.raises(SaveError):  # a trainer error (also an OSError), never a raw one
        backend.wait()
