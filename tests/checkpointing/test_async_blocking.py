"""Async checkpointing that training does not feel (issue 17): the time a save holds the
training loop is reported per save in TensorBoard (``checkpoint/blocking_seconds``, next to
``checkpoint/save_seconds``), and the snapshot, now one traced copy of every variable, still
writes exactly the state of the step it was asked for."""

from __future__ import annotations

import math
from pathlib import Path

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from trainer import train
from trainer.checkpointing import (
    AsyncBackend,
    CheckpointManager,
    CheckpointPolicy,
    all_variables,
    clone_for_snapshot,
    snapshot,
)
from trainer.checkpointing.snapshot import (
    ValueReader,
    refresh_snapshot,
    take_snapshot,
    variable_copier,
)
from trainer.save_backends import get_backend, load_checkpoint
from trainer.state import TrainingState


def scalars(run_dir, tag: str) -> dict[int, float]:
    """``tag``'s values by step, from every event file of the run's TensorBoard log."""
    values = {}
    for events in {p.parent for p in run_dir.rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
        acc.Reload()
        if tag in acc.Tags()["tensors"]:
            for event in acc.Tensors(tag):
                values[event.step] = float(tensor_util.make_ndarray(event.tensor_proto))
    return values


@pytest.mark.parametrize("save,async_save", [("savedmodel", True), ("h5", False)])
def test_every_save_reports_its_blocking_time_next_to_its_write_time(compose_cfg, save, async_save):
    cfg = compose_cfg(
        "model=mlp", f"save={save}", f"checkpoint.policy.async_save={str(async_save).lower()}"
    )
    train(cfg)
    run_dir = Path(cfg.run_dir)
    saved = scalars(run_dir, "checkpoint/save_seconds")
    blocking = scalars(run_dir, "checkpoint/blocking_seconds")
    steps = sorted(load_checkpoint(p, compile=False).state.global_step for p in _kept(run_dir))
    assert steps and set(steps) <= set(saved)
    assert set(blocking) == set(saved)  # one blocking figure per save, at the save's step
    assert all(math.isfinite(b) and b >= 0 for b in blocking.values())
    if not async_save:  # a synchronous save holds the loop for the whole write
        assert all(blocking[step] >= saved[step] for step in saved)


def _kept(run_dir):
    return [
        p
        for p in (run_dir / "checkpoints").iterdir()
        if not p.name.startswith(".") and p.name != "latest"
    ]


def trained_model() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model, x, y


def test_the_traced_copy_takes_every_variable_of_the_step(tmp_path):
    model, x, y = trained_model()
    shadow = clone_for_snapshot(model)
    copier = variable_copier(model, shadow)
    assert copier is not None  # a plain (undistributed) model: one traced call
    refresh_snapshot(model, shadow, copier)
    for mine, theirs in zip(all_variables(model), all_variables(shadow), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # the live model moves on
    refresh_snapshot(model, shadow, copier)  # the same traced copy reads the new values
    for mine, theirs in zip(all_variables(model), all_variables(shadow), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_an_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path):
    model, x, y = trained_model()
    manager = CheckpointManager(
        tmp_path / "ckpt", AsyncBackend(get_backend("h5")), CheckpointPolicy(keep_last=5)
    )
    expected = []
    for step in range(3):
        expected.append([np.array(v) for v in all_variables(model)])
        manager.save(model, TrainingState(global_step=step))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # changes every variable
    manager.close()
    for step, values in enumerate(expected):
        (path,) = [p for p in manager.saved if load_checkpoint(p).state.global_step == step]
        loaded = load_checkpoint(path).model
        for value, variable in zip(values, all_variables(loaded), strict=True):
            np.testing.assert_array_equal(value, np.asarray(variable))


def _values(variables) -> list[np.ndarray]:
    return [np.array(v) for v in variables]


def _assert_equal(values, variables) -> None:
    for value, variable in zip(values, variables, strict=True):
        np.testing.assert_array_equal(value, np.asarray(variable), err_msg=variable.path)


def test_a_snapshot_held_by_reference_keeps_its_step_while_training_moves_on():
    """The training thread only reads the variables; the writer thread completes the shadow
    later, after training has updated them: it must still get the values of the save."""
    model, x, y = trained_model()
    shadow = clone_for_snapshot(model)
    copier = variable_copier(model, shadow)
    assert copier is not None and copier.by_reference  # a small model
    before = _values(all_variables(model))
    complete = take_snapshot(model, shadow, copier)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # before the writer runs
    moved = sum(
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(before, all_variables(model), strict=True)
    )
    assert moved > len(before) // 2
    complete()
    _assert_equal(before, all_variables(shadow))


def test_a_model_above_the_reference_bound_is_copied_before_save_returns(monkeypatch):
    """Above ``BY_REFERENCE_BYTES`` nothing of the model is held beyond the shadow: the copy
    is complete when ``take_snapshot`` returns, and what it returns has nothing left to do."""
    monkeypatch.setattr(snapshot, "BY_REFERENCE_BYTES", 0)
    model, x, y = trained_model()
    shadow = clone_for_snapshot(model)
    copier = variable_copier(model, shadow)
    assert copier is not None and not copier.by_reference
    before = _values(all_variables(model))
    complete = take_snapshot(model, shadow, copier)
    _assert_equal(before, all_variables(shadow))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    complete()
    _assert_equal(before, all_variables(shadow))


def test_the_metric_reader_reads_the_variables_it_is_given_now():
    model, x, y = trained_model()
    read = ValueReader()
    for value, variable in zip(read(model.metrics_variables), model.metrics_variables, strict=True):
        np.testing.assert_array_equal(value, keras.ops.convert_to_numpy(variable))
    model.compile(optimizer="adam", loss="mse", metrics=["mae", "mse"])  # new accumulators
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    values = read(model.metrics_variables)
    assert len(values) == len(model.metrics_variables) > 0
    for value, variable in zip(values, model.metrics_variables, strict=True):
        np.testing.assert_array_equal(value, keras.ops.convert_to_numpy(variable))


def test_a_mixed_precision_model_is_saved_by_reference_with_the_values_of_its_step(tmp_path):
    """Under ``mixed_float16`` (set for the whole run, as Keras documents it) the float32
    variables are read where they are kept, never through an autocast, and by reference,
    while training goes on after the save; the loss-scale optimizer's own variables too."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model, x, y = trained_model()
        backend = AsyncBackend(get_backend("savedmodel"))
        manager = CheckpointManager(tmp_path / "ckpt", backend, CheckpointPolicy(keep_last=5))
        manager.save(model, TrainingState(global_step=0))  # the copier is traced after it
        manager.wait()
        assert backend._copier is not None and backend._copier.by_reference
        before = _values(all_variables(model))
        path = manager.save(model, TrainingState(global_step=1))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        manager.close()
        loaded = load_checkpoint(path).model
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
    _assert_equal(before, all_variables(loaded))
