"""The ``callbacks`` config: Keras callbacks added by name from config, in order."""

from __future__ import annotations

import csv

import keras
import pytest

from trainer import train
from trainer.errors import ConfigError

calls: list[tuple[str, int]] = []


class Record(keras.callbacks.Callback):
    """Appends ``(name, global batch count)`` to ``calls`` after every training batch."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def on_train_batch_end(self, batch, logs=None):
        calls.append((self.name, int(self.model.optimizer.iterations.numpy())))


def test_config_callbacks_run_in_order_and_null_leaves_one_out(compose_cfg):
    calls.clear()
    train(
        compose_cfg(
            "model=mlp",
            "save=h5",
            "+callbacks.first={_target_: tests.training.test_user_callbacks.Record, name: a}",
            "+callbacks.off={_target_: tests.training.test_user_callbacks.Record, name: off}",
            "+callbacks.second={_target_: tests.training.test_user_callbacks.Record, name: b}",
            "callbacks.off=null",
        )
    )
    assert calls == [(name, step) for step in range(1, 7) for name in ("a", "b")]


def test_a_keras_callback_from_config_sees_every_epoch(compose_cfg, tmp_path):
    log = tmp_path / "metrics.csv"
    train(
        compose_cfg(
            "model=mlp",
            "save=h5",
            f"+callbacks.csv={{_target_: keras.callbacks.CSVLogger, filename: '{log}', "
            "append: true}",
        )
    )
    rows = list(csv.DictReader(log.open()))
    assert [row["epoch"] for row in rows] == ["0", "1"] and "val_loss" in rows[0]


def test_an_entry_that_is_not_a_callback_is_refused(compose_cfg):
    cfg = compose_cfg("model=mlp", "save=h5", "+callbacks.bad={_target_: builtins.dict}")
    with pytest.raises(ConfigError, match=r"callbacks\.bad must build a keras\.callbacks"):
        train(cfg)


def test_a_rate_setting_callback_with_a_schedule_is_refused_before_the_first_step(
    compose_cfg, tmp_path
):
    """Keras would raise a raw TypeError at the first plateau, epochs into the run."""
    cfg = compose_cfg("model=mlp", "save=h5", "callbacks=[reduce_lr_on_plateau]")
    assert cfg.schedule._target_.endswith("CosineDecay")  # the default schedule
    with pytest.raises(ConfigError, match=r"callbacks\.reduce_lr_on_plateau .* schedule=none"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained or saved


@pytest.mark.parametrize(
    ("callback", "override", "received"),
    [
        ("early_stopping", "patience=abc", "'abc'"),
        ("early_stopping", "patience=-1", "-1"),
        ("early_stopping", "start_from_epoch=abc", "'abc'"),
        ("early_stopping", "min_delta=abc", "'abc'"),
        ("early_stopping", "min_delta=-0.5", "-0.5"),
        ("early_stopping", "mode=foo", "'foo'"),
        ("early_stopping", "verbose=abc", "'abc'"),
        ("early_stopping", "restore_best_weights=abc", "'abc'"),
        ("reduce_lr_on_plateau", "cooldown=-2", "-2"),
        ("reduce_lr_on_plateau", "factor=0", "0"),
    ],
)
def test_a_bad_plateau_callback_setting_is_refused_at_start(
    compose_cfg, tmp_path, callback, override, received
):
    """Keras stores these unchecked: patience=abc crashed with a raw TypeError at the first
    epoch without improvement, mode=foo silently became auto. Refused before anything runs."""
    key = override.split("=")[0]
    cfg = compose_cfg(
        "model=mlp",
        "save=h5",
        "schedule=none",
        f"callbacks=[{callback}]",
        f"callbacks.{callback}.{override}",
        # Never an improvement after the first epoch: Keras compares patience at once.
        *([f"callbacks.{callback}.min_delta=100"] if key != "min_delta" else []),
    )
    with pytest.raises(ConfigError) as refused:
        train(cfg)
    message = str(refused.value)
    assert f"callbacks.{callback}.{key}" in message
    assert message.endswith(f"Received: {received}")
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained or saved


@pytest.mark.parametrize(
    "overrides",
    [
        ["schedule=cosine", "callbacks=[reduce_lr_on_plateau]"],  # a rate setter, a schedule
        ["+callbacks.bad={_target_: builtins.dict}"],  # not a callback
        ["callbacks=[early_stopping]", "callbacks.early_stopping.patience=abc"],
    ],
)
def test_a_run_refused_for_its_callbacks_leaves_no_tensorboard_files(
    compose_cfg, tmp_path, overrides
):
    """The refusal came after the session-start mark, the event file and the model graph
    were written into tb/: a refused run looked like a run that happened."""
    with pytest.raises(ConfigError):
        train(compose_cfg("model=mlp", "save=h5", *overrides))
    board = tmp_path / "run" / "tb"
    assert not board.exists() or not any(board.rglob("*")), sorted(board.rglob("*"))
