"""Callbacks whose state a Checkpoint carries (``track=``), found by a kill/resume probe:

- listed after the Checkpoint, their epoch-end state was saved from the epoch before
  (EarlyStopping stopped an epoch late after a resume): refused when fit starts;
- a mid-epoch resume replays the epoch's first batches, and Keras shows them to every
  callback after the tracked state was put back (a batch counter counted them twice, and
  the learning rate it drove changed the weights): the state is put back after the replay;
- a callback without readable state was accepted in ``track`` and silently not saved.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.callbacks import Checkpoint
from trainer.errors import ConfigError

X = np.random.default_rng(0).normal(size=(192, 8)).astype("float32")
Y = (X[:, :4].sum(axis=1) > 0).astype("int32")


class BatchCounter(keras.callbacks.Callback):
    """A warm-up driven by the batches seen, with its count as resumable state."""

    def __init__(self):
        super().__init__()
        self.batches = 0

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.learning_rate = 0.01 / (1 + 0.05 * self.batches)

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


class _Crash(Exception):
    pass


class _CrashAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self.step:
            raise _Crash


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.Adam(0.01), loss)
    return model


def _fit(model, callbacks):
    return model.fit(X, Y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)


def test_a_mid_epoch_resume_gives_tracked_callbacks_the_state_of_the_checkpoint(tmp_path):
    whole, counter = _model(), BatchCounter()
    history = _fit(whole, [counter])

    def run(extra):
        model, mine = _model(), BatchCounter()
        checkpoint = Checkpoint(
            tmp_path / "ckpt", backend="weights", every_n_steps=3, track={"counter": mine}
        )
        return model, mine, _fit(model, [mine, checkpoint, *extra])

    with pytest.raises(_Crash):
        run([_CrashAt(10)])  # saved at step 9: three batches into the second epoch
    resumed, mine, again = run([])
    assert mine.batches == counter.batches == 24
    assert again.history["loss"] == history.history["loss"][1:]
    for a, b in zip(whole.variables, resumed.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def test_tracked_callbacks_after_the_checkpoint_are_refused(tmp_path):
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1)
    checkpoint = Checkpoint(tmp_path / "ckpt", track={"stop": stopper})
    with pytest.raises(ConfigError, match=r"must come before it.*Received: \['stop'\]"):
        _fit(_model(), [checkpoint, stopper])
    with pytest.raises(ConfigError, match="not passed to fit"):
        _fit(_model(), [checkpoint])
    _fit(_model(), [stopper, checkpoint])  # in order: trains


def test_a_tracked_callback_without_readable_state_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"state_dict\(\).*Received without state: \['log'\]"):
        Checkpoint(tmp_path / "ckpt", track={"log": keras.callbacks.CSVLogger("x.csv")})
