"""One ``fit`` per run (issue 15, item 3): Keras sees one training, its progress bar counts
epochs from 1 to N, and a resumed epoch counts on from the batches trained before the stop."""

from __future__ import annotations

import re

import keras
import numpy as np

from trainer import train
from trainer.data import epoch_dataset, run_dataset
from trainer.save_backends import load_checkpoint
from trainer.training import progress

begins: list[int] = []


class CountTrainBegins(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        begins.append(int(self.model.optimizer.iterations.numpy()))


def _epoch_sections(text: str) -> dict[str, str]:
    """Progress output split at each ``Epoch i/N`` header."""
    parts = re.split(r"(Epoch \d+/\d+)", text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _counters(section: str, total: int) -> list[int]:
    return [int(n) for n in re.findall(rf"(\d+)/{total}\b", section)]


def test_one_fit_prints_every_epoch_and_starts_training_once(compose_cfg, capsys):
    begins.clear()
    train(
        compose_cfg(
            "model=mlp",
            "save=h5",
            "trainer.epochs=3",
            "trainer.verbose=1",
            "+callbacks.count={_target_: tests.training.test_one_fit.CountTrainBegins}",
        )
    )
    out = capsys.readouterr().out
    assert re.findall(r"Epoch \d+/\d+", out) == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    assert begins == [0]  # one fit: on_train_begin once, before the first step


def test_a_resumed_epoch_counts_on_from_the_batches_already_trained(
    compose_cfg, capsys, tmp_path, monkeypatch
):
    # The live bar, as a terminal shows it (captured output is no terminal: one line per epoch).
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)
    run = tmp_path / "run"
    base = ["model=mlp", "save=h5", "trainer.epochs=3", "trainer.verbose=1"]
    # 3 steps per epoch; the signal after step 4 stops after step 5: epoch 2, 2 batches done.
    train(compose_cfg(*base, "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}"))
    stopped = load_checkpoint(run / "checkpoints" / "latest").state
    assert (stopped.epoch, stopped.step_in_epoch) == (1, 2)
    first = _epoch_sections(capsys.readouterr().out)
    assert list(first) == ["Epoch 1/3", "Epoch 2/3"]
    assert max(_counters(first["Epoch 2/3"], 3)) == 2  # stopped at 2/3, not shown as 3/3

    train(compose_cfg(*base, "resume=latest", f"resume_dir={run}"))
    resumed = _epoch_sections(capsys.readouterr().out)
    assert list(resumed) == ["Epoch 2/3", "Epoch 3/3"]
    assert set(_counters(resumed["Epoch 2/3"], 3)) == {3}  # the one batch left: 3/3
    assert 1 in _counters(resumed["Epoch 3/3"], 3)  # a full epoch again
    final = load_checkpoint(run / "checkpoints" / "latest").state
    assert (final.epoch, final.step_in_epoch, final.global_step) == (3, 0, 9)


def test_run_dataset_is_the_epochs_in_order_without_the_consumed_batches():
    x = np.arange(22, dtype="float32")[:, None]
    y = np.arange(22, dtype="int32")
    kwargs = {"batch_size": 4, "seed": 5, "max_batches": 5}  # 20 of 22 examples per epoch
    expected = [
        b[1].numpy().tolist()
        for epoch in (1, 2, 3)
        for b in epoch_dataset(x, y, epoch=epoch, skip_batches=2 if epoch == 1 else 0, **kwargs)
    ]
    dataset = run_dataset(x, y, epochs=4, first_epoch=1, skip_batches=2, **kwargs)
    got = [b[1].numpy().tolist() for b in dataset]
    assert got == expected and len(got) == 3 + 5 + 5
    assert int(dataset.cardinality()) == len(got)
