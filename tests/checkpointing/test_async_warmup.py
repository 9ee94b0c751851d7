"""Async checkpointing prepares at the start of training (issue 17): the shadow copy is built
and the backend's first-save work (the SavedModel trace, the traced variable copy) is done
in the background during the first epoch, so no save of the run waits for it. It writes
nothing into the checkpoint directory, removes its rehearsal, and every checkpoint still
holds exactly the state of the step it was taken at."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import keras
import numpy as np
import pytest

from tests.helpers.checkpoints import list_checkpoints
from trainer.checkpointing import AsyncBackend, Checkpoint, all_variables, numpy_rng_record
from trainer.checkpointing.rehearsal import PREFIX, remove_stale
from trainer.checkpointing.snapshot import copy_state
from trainer.save_backends import load_checkpoint
from trainer.save_backends.savedmodel.layout import metadata_path
from trainer.state import TrainingState


@pytest.fixture
def system_tmp(tmp_path, monkeypatch):
    """The system temporary directory, isolated: where a rehearsal writes and removes."""
    where = tmp_path / "system-tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def small_model() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 6)).astype("float32"), rng.normal(size=(48, 2)).astype("float32")
    return model, x, y


class Recorder(keras.callbacks.Callback):
    """Before the checkpoint callback: every variable at each epoch end (what that epoch's
    save must hold), and the checkpoint directory's entries after every batch."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory
        self.values: dict[int, list[np.ndarray]] = {}
        self.seen: list[list[str]] = []

    def on_train_batch_end(self, batch, logs=None):
        names = sorted(p.name for p in self.directory.iterdir()) if self.directory.exists() else []
        self.seen.append(names)

    def on_epoch_end(self, epoch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.values[step] = [np.array(v) for v in all_variables(self.model)]


def fit_with_checkpoints(tmp_path, **policy):
    model, x, y = small_model()
    directory = tmp_path / "ckpt"
    recorder = Recorder(directory)
    checkpoint = Checkpoint(directory, "savedmodel", keep_last=None, **policy)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[recorder, checkpoint])
    return checkpoint, recorder, directory


def test_every_save_reuses_the_trace_made_in_the_first_epoch_and_holds_its_step(
    tmp_path, system_tmp
):
    checkpoint, recorder, directory = fit_with_checkpoints(tmp_path, async_save=True)
    assert isinstance(checkpoint.manager.backend, AsyncBackend)
    saved = list_checkpoints(directory)
    assert len(saved) == 3
    for path in saved:  # before: the first checkpoint traced the model (full_save true)
        assert json.loads(metadata_path(path).read_text())["full_save"] is False
    # Nothing but the run's own checkpoints ever appeared in the checkpoint directory.
    first_epoch = recorder.seen[: len(recorder.seen) // 3]
    assert all(names == [] for names in first_epoch)
    own = {p.name for p in saved} | {"latest"}
    for name in {n for names in recorder.seen for n in names}:  # or their temporaries
        assert name in own or (name.startswith(".") and name[1:].split(".tmp-")[0] in own)
    assert list(system_tmp.glob(f"{PREFIX}*")) == []  # the rehearsal removed what it wrote
    # Every checkpoint, the first included, holds exactly the state of its step.
    by_step = {load_checkpoint(p).state.global_step: p for p in saved}
    assert sorted(by_step) == sorted(recorder.values)
    for step, values in recorder.values.items():
        loaded = load_checkpoint(by_step[step]).model
        for value, variable in zip(values, all_variables(loaded), strict=True):
            np.testing.assert_array_equal(value, np.asarray(variable))


def test_a_rehearsal_that_cannot_write_leaves_the_work_to_the_first_save(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "does-not-exist"))
    _, recorder, directory = fit_with_checkpoints(tmp_path, async_save=True)
    saved = list_checkpoints(directory)
    full = [json.loads(metadata_path(p).read_text())["full_save"] for p in saved]
    assert full == [True, False, False]  # the first save traced, as without a rehearsal
    last = load_checkpoint(directory / "latest")
    for value, variable in zip(
        recorder.values[last.state.global_step], all_variables(last.model), strict=True
    ):
        np.testing.assert_array_equal(value, np.asarray(variable))


def test_no_preparation_when_the_policy_saves_nothing_during_fit(tmp_path, system_tmp):
    checkpoint, _, directory = fit_with_checkpoints(
        tmp_path, async_save=True, every_n_epochs=None, on_train_end=False
    )
    assert checkpoint.manager.backend._shadow is None  # no shadow copy held for nothing
    assert not directory.exists() or list_checkpoints(directory) == []


def test_a_second_fit_of_the_same_model_does_not_prepare_again(tmp_path, system_tmp):
    model, x, y = small_model()
    checkpoint = Checkpoint(tmp_path / "ckpt", "savedmodel", async_save=True)
    busy = []

    class AfterCheckpoint(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            busy.append(checkpoint.manager.backend.writer.busy)

    for epochs in (1, 2):  # resume="auto": the second fit trains the second epoch
        model.fit(
            x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[checkpoint, AfterCheckpoint()]
        )
    assert busy[0] is True  # the first fit's preparation runs in the background
    assert busy[1] is False  # the second has nothing left to prepare: no rehearsal again
    assert len(list_checkpoints(tmp_path / "ckpt")) == 2


def test_a_rehearsal_left_by_a_killed_process_is_removed(system_tmp):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    dead = system_tmp / f"{PREFIX}{int(gone.stdout)}-abc"
    alive = system_tmp / f"{PREFIX}{1}-abc"  # init: a live process, maybe rehearsing
    unrelated = system_tmp / "someone-else-123-abc"
    for each in (dead, alive, unrelated):
        (each / "write").mkdir(parents=True)
    assert remove_stale() == [dead]
    assert not dead.exists() and alive.exists() and unrelated.exists()


def test_the_state_copied_for_a_write_shares_nothing_mutable_with_the_live_one():
    state = TrainingState(global_step=7, epoch=1, numpy_rng=numpy_rng_record())
    state.callbacks = {"early_stopping": {"wait": 1, "best": [0.5]}}
    state.metric_variables = [[1.0, 2.0]]
    copied = copy_state(state)
    assert copied == state
    state.numpy_rng[1][0] += 1  # the live run moves on: the write must not see it
    state.callbacks["early_stopping"]["best"].append(0.4)
    state.metric_variables[0][0] = 9.0
    assert copied.numpy_rng[1][0] == state.numpy_rng[1][0] - 1
    assert copied.callbacks["early_stopping"]["best"] == [0.5]
    assert copied.metric_variables == [[1.0, 2.0]]
