"""``fit``/``compile`` options the step counting and the saved state must follow (found by a
probe of Keras 3's compile and fit options through the Checkpoint callback):

- ``steps_per_execution``: Keras calls ``on_train_batch_end`` once per execution, with the
  index of its last batch (and ``begin + steps_per_execution - 1`` for an epoch's shorter
  last execution too). Counting calls made the steps, checkpoint names and a mid-epoch
  resume's replay wrong: the resumed run trained 31 steps where an uninterrupted one
  trains 28, and ended with other weights.
- Array-valued metrics (``F1Score()`` per class): the callback crashed with a raw
  ``TypeError`` turning them into floats at the first epoch end; nothing was saved.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.callbacks import Checkpoint
from trainer.save_backends import load_checkpoint
from trainer.state import TrainingState
from trainer.training.progress import RunProgress

RNG = np.random.default_rng(0)
X = RNG.normal(size=(84, 8)).astype("float32")
Y = np.argmax(X[:, :3], axis=1)


def _model(**compile_options) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.Adam(0.01), loss, **compile_options)
    return model


class _Crash(Exception):
    pass


class _CrashAt(keras.callbacks.Callback):
    """Ends the process's training abruptly (as a kill would) once ``step`` steps ran."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self.step:
            raise _Crash


def test_steps_per_execution_counts_steps_and_resumes_mid_epoch_exactly(tmp_path):
    options = {"metrics": ["accuracy"], "steps_per_execution": 3}  # 7 steps an epoch at 12
    whole = _model(**options)
    history = whole.fit(X, Y, batch_size=12, epochs=4, shuffle=False, verbose=0)

    def checkpoint():
        return Checkpoint(tmp_path / "ckpt", backend="weights", every_n_steps=5, async_save=False)

    crashed = _model(**options)
    with pytest.raises(_Crash):
        crashed.fit(
            X, Y, batch_size=12, epochs=4, shuffle=False, verbose=0,
            callbacks=[checkpoint(), _CrashAt(13)],
        )  # fmt: skip
    # Saved where a multiple of 5 steps was reached (6, 10) and at the epoch end (7).
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step"))
    assert names == ["step-00000006", "step-00000007", "step-00000010"]
    latest = load_checkpoint(tmp_path / "ckpt" / "step-00000010")
    assert int(latest.model.optimizer.iterations) == latest.state.global_step == 10
    assert (latest.state.epoch, latest.state.step_in_epoch) == (1, 3)

    resumed = _model(**options)
    again = resumed.fit(
        X, Y, batch_size=12, epochs=4, shuffle=False, verbose=0, callbacks=[checkpoint()]
    )
    assert int(resumed.optimizer.iterations) == int(whole.optimizer.iterations) == 28
    assert again.history["loss"] == history.history["loss"][1:]  # epochs 2-4
    for mine, theirs in zip(whole.variables, resumed.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs), err_msg=mine.path)


def test_the_runs_step_counter_counts_steps_under_steps_per_execution():
    model = _model(steps_per_execution=3)
    state = TrainingState()
    model.fit(
        X, Y, batch_size=12, epochs=2, shuffle=False, verbose=0, callbacks=[RunProgress(state, 7)]
    )
    assert state.global_step == int(model.optimizer.iterations) == 14


def test_array_valued_metrics_are_saved_and_left_out_of_the_recorded_logs(tmp_path):
    model = _model()
    y = keras.utils.to_categorical(Y, 3)
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.F1Score(average=None), "accuracy"],
    )
    model.fit(X, y, batch_size=12, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path / "c")])
    checkpoint = load_checkpoint(tmp_path / "c" / "latest")
    assert set(checkpoint.state.metrics) == {"loss", "accuracy"}
    assert "F1Score" in str(checkpoint.model.get_compile_config()["metrics"])  # still compiled
    got = checkpoint.model.evaluate(X, y, verbose=0, return_dict=True)["f1_score"]
    np.testing.assert_array_equal(
        got, model.evaluate(X, y, verbose=0, return_dict=True)["f1_score"]
    )
