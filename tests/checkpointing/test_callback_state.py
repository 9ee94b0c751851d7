"""The ``callbacks`` config group and callback state in checkpoints (issue 15, items 4, 5).

EarlyStopping and ReduceLROnPlateau from ``conf/callbacks`` act across the whole run, and
their counters travel with every checkpoint: a run stopped by SIGTERM or killed by SIGKILL and
resumed stops at the same epoch, with the same rates and weights, as one that never stopped.
"""

from __future__ import annotations

import csv
import signal
import sys

import keras
import numpy as np
import pytest

from tests.helpers import warm
from tests.helpers.config import compose_run
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer import train
from trainer.checkpointing import all_variables
from trainer.errors import ConfigError
from trainer.save_backends import load_checkpoint
from trainer.training.user_callbacks import load_state

# Nothing counts as an improvement (min_delta=100): EarlyStopping stops after its patience
# (epoch 4 of 8) and ReduceLROnPlateau halves the rate after every epoch but the first.
PLATEAU = [
    "model=mlp",
    "model.dropout=0.3",
    "save=h5",
    "trainer.epochs=8",
    # ReduceLROnPlateau sets the rate: a float rate, not the default cosine schedule
    "optimizer.learning_rate=0.001",
    "schedule=none",
    "callbacks=[early_stopping,reduce_lr_on_plateau,csv_logger]",
    "callbacks.early_stopping.patience=3",
    "callbacks.early_stopping.min_delta=100",
    "callbacks.reduce_lr_on_plateau.patience=1",
    "callbacks.reduce_lr_on_plateau.min_delta=100",
]


def finished(run):
    checkpoint = load_checkpoint(run / "checkpoints" / "latest")
    values = [np.asarray(v.numpy()) for v in all_variables(checkpoint.model)]
    rate = float(checkpoint.model.optimizer.learning_rate.numpy())
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    return checkpoint.state, values, rate, rows


def assert_same_run(got, want):
    (state, values, rate, rows), (state0, values0, rate0, rows0) = got, want
    assert (state.epoch, state.global_step) == (state0.epoch, state0.global_step)
    assert rate == rate0
    assert rows == rows0
    assert state.history == state0.history
    for mine, theirs in zip(values, values0, strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """What the PLATEAU run never stopped leaves: trained once for both tests that compare
    an interrupted run with it (they only read it)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(compose_run(run, *PLATEAU))
    return finished(run)


def test_early_stopping_ends_the_run_and_reduce_lr_lowers_the_rate(compose_cfg, tmp_path):
    run = tmp_path / "run"
    cfg = compose_cfg(*PLATEAU)
    assert cfg.callbacks.early_stopping._target_ == "keras.callbacks.EarlyStopping"
    train(cfg)
    state, _, rate, rows = finished(run)
    assert state.epoch == 4 < 8 and state.stopped_early is True
    assert state.callbacks["early_stopping"]["stopped_epoch"] == 3
    assert rate == pytest.approx(0.001 * 0.5**3, rel=1e-6)  # lowered after epochs 2, 3 and 4
    used = [float(r["learning_rate"]) for r in rows]  # the rate each epoch trained with
    assert used == pytest.approx([0.001, 0.001, 0.0005, 0.00025], rel=1e-6)
    # Resuming a run that a callback ended trains nothing more.
    train(compose_cfg(*PLATEAU, "resume=latest", f"resume_dir={run}"))
    assert load_checkpoint(run / "checkpoints" / "latest").state.global_step == 12


def test_sigterm_and_resume_stops_at_the_same_epoch(compose_cfg, tmp_path, straight):
    expected = straight

    broken = tmp_path / "broken"
    # 3 steps per epoch: stopped after step 8, in the middle of epoch 3.
    hook = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 7}"
    train(compose_cfg(*PLATEAU, f"run_dir={broken}", hook))
    stopped = load_checkpoint(broken / "checkpoints" / "latest").state
    assert (stopped.epoch, stopped.step_in_epoch) == (2, 2)
    assert stopped.callbacks["early_stopping"]["wait"] == 1
    assert len(list(csv.DictReader((broken / "metrics.csv").open()))) == 2  # no partial row

    train(compose_cfg(*PLATEAU, "resume=latest", f"resume_dir={broken}"))
    assert_same_run(finished(broken), expected)


@pytest.mark.slow
def test_sigkill_and_rerun_stops_at_the_same_epoch(tmp_path, straight):
    """``python train.py`` killed by SIGKILL in epoch 3, after the epoch-2 checkpoint (and
    its CSV row), then run again with resume=latest: same stop, rates, rows and weights."""
    expected = straight

    run = tmp_path / "killed"
    command = [
        sys.executable, str(ROOT / "train.py"), *PLATEAU, "data=synthetic",
        "trainer.batch_size=16", "trainer.steps_per_epoch=3", "trainer.verbose=0",
        "export.enabled=false", f"hydra.run.dir={run}", "hydra/job_logging=disabled",
    ]  # fmt: skip
    kill = f"+callbacks.kill={{_target_: faults.SignalAtStep, step: 7, signum: {signal.SIGKILL}}}"
    first = warm.run(
        [*command, kill], env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert load_checkpoint(run / "checkpoints" / "latest").state.global_step == 6
    again = warm.run(
        [*command, "resume=latest"], env=subprocess_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert_same_run(finished(run), expected)


def test_early_stopping_that_restores_best_weights_is_refused_on_resume():
    callback = keras.callbacks.EarlyStopping(restore_best_weights=True)
    with pytest.raises(ConfigError, match=r"'stop' .*callbacks\.stop\.restore_best_weights=fa"):
        load_state("stop", callback, {"wait": 1, "best": 0.5, "best_epoch": 2})
    load_state("stop", callback, {"wait": 0, "best": None})  # nothing best yet: fine


def test_csv_logger_drops_rows_logged_after_the_checkpoint(tmp_path):
    """A crash between an epoch's CSV row and its checkpoint: the resumed run's logger keeps
    the rows its checkpoint counted and logs the repeated epoch once."""
    from trainer.callbacks import CSVLogger

    (tmp_path / "metrics.csv").write_text("epoch,loss\r\n0,1.0\r\n1,0.5\r\n2,0.25\r\n")
    logger = CSVLogger("metrics.csv")
    logger.set_run_dir(tmp_path)
    logger.on_train_begin()
    logger.load_state_dict({"rows": 2})  # the checkpoint was taken after epoch 2
    logger.on_epoch_end(2, {"loss": 0.3})
    logger.on_train_end()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["epoch"], r["loss"]) for r in rows] == [("0", "1.0"), ("1", "0.5"), ("2", "0.3")]
    assert logger.state_dict() == {"rows": 3}


@pytest.mark.parametrize(
    ("callback", "saved"),
    [
        (keras.callbacks.EarlyStopping(), {"wait": 0, "best": "abc"}),
        (keras.callbacks.EarlyStopping(), {"wait": -1, "best": 0.5}),
        (keras.callbacks.ReduceLROnPlateau(), {"wait": 1.5, "cooldown_counter": 0}),
        ("csv", {"rows": "abc"}),
        (keras.callbacks.EarlyStopping(), ["not", "a", "dict"]),
    ],
)
def test_damaged_callback_state_is_refused_when_the_run_is_built(tmp_path, callback, saved):
    """The checkpoint's callback state was applied as stored: best="abc" failed with a raw
    error at the first epoch's end, rows="abc" with a raw ValueError, after the session
    had started writing. Refused when the callbacks are built, before anything is written."""
    from trainer.callbacks import CSVLogger
    from trainer.errors import CorruptCheckpointError
    from trainer.state import TrainingState
    from trainer.training.user_callbacks import ConfigCallbacks

    if callback == "csv":
        callback = CSVLogger(str(tmp_path / "metrics.csv"))
    with pytest.raises(CorruptCheckpointError, match=r"is damaged: .*Received"):
        ConfigCallbacks({"mine": callback}, TrainingState(), {"mine": saved})


def test_csv_logger_without_append_keeps_the_rows_of_a_resumed_run(tmp_path):
    """append=False: Keras empties the file when training begins, so a resumed session lost
    every row its checkpoint had counted; it keeps them, and a fresh run starts empty."""
    from trainer.callbacks import CSVLogger

    (tmp_path / "metrics.csv").write_text("epoch,loss\r\n0,1.0\r\n1,0.5\r\n2,0.25\r\n")
    resumed = CSVLogger("metrics.csv", append=False)
    resumed.set_run_dir(tmp_path)
    resumed.on_train_begin()
    resumed.load_state_dict({"rows": 2})
    resumed.on_epoch_end(2, {"loss": 0.3})
    resumed.on_train_end()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["epoch"], r["loss"]) for r in rows] == [("0", "1.0"), ("1", "0.5"), ("2", "0.3")]
    fresh = CSVLogger("metrics.csv", append=False)
    fresh.set_run_dir(tmp_path)
    fresh.on_train_begin()
    fresh.on_epoch_end(0, {"loss": 0.9})
    fresh.on_train_end()
    assert [r["loss"] for r in csv.DictReader((tmp_path / "metrics.csv").open())] == ["0.9"]


def test_a_callback_state_json_cannot_hold_is_named_not_blamed_on_the_disk(tmp_path):
    """A configured callback's state_dict() returning a NumPy float failed inside the save
    as "free space or fix permissions", and on_save_error=continue trained on without it."""
    from trainer.checkpointing import Checkpoint

    class Counting(keras.callbacks.Callback):
        def state_dict(self):
            return {"seen": np.float32(1.5)}

        def load_state_dict(self, state):
            pass

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    counting = Counting()
    saves = Checkpoint(tmp_path / "ckpt", backend="h5", track={"counting": counting},
                       on_save_error="continue")  # fmt: skip
    with pytest.raises(ConfigError, match=r"state_dict\(\) of callback Counting must return JSON"):
        model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0, callbacks=[counting, saves])


def test_a_fresh_run_moves_rows_of_an_earlier_session_aside(compose_cfg, tmp_path):
    """A session killed after logging a row but before its first checkpoint: the same
    command then starts anew in that run directory, and the rows it appended to showed the
    epochs twice (0, 0, 1, 2; found by a probe). The earlier rows are kept beside it."""
    run = tmp_path / "run"
    run.mkdir()
    stale = "epoch,loss\r\n0,9.0\r\n"
    (run / "metrics.csv").write_text(stale)
    train(compose_cfg("model=mlp", "save=h5", "trainer.epochs=2", "callbacks=[csv_logger]"))
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert (run / "metrics.csv.abandoned-1").read_bytes() == stale.encode()


def test_a_csv_file_outside_the_run_directory_is_appended_to(tmp_path):
    """An absolute filename is the user's own file: a fresh run appends, moves nothing."""
    from trainer.callbacks import CSVLogger
    from trainer.state import TrainingState
    from trainer.training.user_callbacks import ConfigCallbacks

    shared = tmp_path / "all_runs.csv"
    shared.write_text("epoch,loss\r\n0,9.0\r\n")
    logger = CSVLogger(str(shared))
    logger.set_run_dir(tmp_path / "run")
    callbacks = ConfigCallbacks({"csv": logger}, TrainingState())
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callbacks.set_model(model)
    callbacks.on_train_begin()
    logger.on_epoch_end(0, {"loss": 0.5})
    logger.on_train_end()
    assert [r["loss"] for r in csv.DictReader(shared.open())] == ["9.0", "0.5"]
    assert not list(tmp_path.glob("*.abandoned-*"))
