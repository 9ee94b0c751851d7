"""Optimizer features whose state a checkpoint lost or misread (found by a probe of Keras
3's optimizer options through every backend):

- ``use_ema``: ``fit`` replaces the weights by their moving averages before
  ``on_train_end``, and the final save stored those as the weights to train on from;
- ``exclude_from_weight_decay`` under a ``LossScaleOptimizer`` (its inner optimizer
  decays) was not recorded: the load decayed the excluded variables;
- ``compile(auto_scale_loss=False)`` under ``mixed_float16``: Keras leaves it out of the
  compile config, the load wrapped the optimizer and refused its own checkpoint as damaged;
- gradient accumulation: ``CheckpointManager.save`` named the step by ``iterations``
  (batches divided by the accumulation steps), so a save a batch later was skipped.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.callbacks import Checkpoint
from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.save_backends import get_backend

BACKENDS = ("savedmodel", "h5", "weights")
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 16)).astype("float32")
Y = X[:, :4].sum(axis=1, keepdims=True)


def _model(optimizer, **compile_options) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=optimizer, loss="mse", **compile_options)
    return model


def _assert_equal_variables(mine: list, theirs: list) -> None:
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def _trains_on_the_same(model: keras.Model, loaded: keras.Model) -> None:
    _assert_equal_variables(model.optimizer.variables, loaded.optimizer.variables)
    losses = [[m.train_on_batch(X[:8], Y[:8]) for _ in range(8)] for m in (model, loaded)]
    assert losses[0] == losses[1]
    _assert_equal_variables(model.variables, loaded.variables)


def _ema_run(directory, epochs: int, checkpoint: bool) -> keras.Model:
    model = _model(keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5))
    callbacks = [Checkpoint(directory, backend="weights", every_n_steps=3, every_n_epochs=None)]
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks if checkpoint else [],
    )
    return model


def test_ema_run_resumed_from_its_final_save_ends_as_one_never_stopped(tmp_path):
    """The final save (step 8, at the end of fit: not a multiple of every_n_steps) holds
    the weights training continues from, not their moving averages that fit swaps in."""
    whole = _ema_run(tmp_path / "unused", 4, checkpoint=False)
    first = _ema_run(tmp_path / "ckpt", 2, checkpoint=True)
    assert "finalize_variable_values" not in vars(first.optimizer)  # the hook is removed
    resumed = _ema_run(tmp_path / "ckpt", 4, checkpoint=True)
    _assert_equal_variables(whole.variables, resumed.variables)
    _assert_equal_variables(whole.optimizer.variables, resumed.optimizer.variables)


def test_ema_fit_still_ends_with_the_moving_averages_in_the_model(tmp_path):
    """Keras's behaviour for the live model is kept: after fit it holds the averages."""
    model = _ema_run(tmp_path / "ckpt", 2, checkpoint=True)
    plain = _ema_run(tmp_path / "none", 2, checkpoint=False)
    _assert_equal_variables(model.variables, plain.variables)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_decay_exclusions_of_a_loss_scaled_optimizer_come_back(backend, tmp_path):
    inner = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    inner.exclude_from_weight_decay(var_names=["bias"])
    model = _model(keras.optimizers.LossScaleOptimizer(inner))
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    loaded = get_backend(backend).load(get_backend(backend).save(model, tmp_path / "c")).model
    _trains_on_the_same(model, loaded)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_without_loss_scaling_loads_unwrapped(backend, async_save, tmp_path):
    """Async: the shadow, compiled by Keras from the config, had a LossScaleOptimizer the
    model had not, and every async save was refused (14 variables vs 18)."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = _model("adam", auto_scale_loss=False)
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        policy = CheckpointPolicy(async_save=async_save)
        with CheckpointManager(tmp_path / "ckpt", backend=backend, policy=policy) as manager:
            manager.save(model)
            manager.wait()
            path = manager.latest()
        keras.mixed_precision.set_dtype_policy("float32")  # a new process's global policy
        loaded = get_backend(backend).load(path).model
        assert not isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        _trains_on_the_same(model, loaded)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def test_manager_saves_a_batch_apart_under_gradient_accumulation(tmp_path):
    model = _model(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))
    with CheckpointManager(tmp_path / "ckpt", backend="h5") as manager:
        model.fit(X[:16], Y[:16], batch_size=8, verbose=0)  # two batches: one update
        first = manager.save(model)
        model.fit(X[:8], Y[:8], batch_size=8, verbose=0)  # a third: gradients accumulated
        second = manager.save(model)
        assert first is not None and second is not None and first != second
        restored = manager.restore().model
    _assert_equal_variables(model.optimizer.variables, restored.optimizer.variables)
