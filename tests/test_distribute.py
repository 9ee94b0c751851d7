"""tf.distribute: MirroredStrategy on 2 logical CPUs and MultiWorkerMirroredStrategy with two
worker processes on 127.0.0.1, checkpoints across strategies, resume, worker cleanup.

Strategies need a fresh process (logical devices and collectives are configured before
TensorFlow initialises), so they run in children; the single-device runs and every check
run here, without any strategy.

Tolerance: a step under a strategy sums per-replica gradients in another order than one
device does, so variables agree to ``RTOL``/``ATOL`` (measured on this model after 6-9
steps: max abs difference 2e-7, relative 1e-6), not bitwise. Runs under the same strategy
are bitwise repeatable, including an interrupted and resumed one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY, subprocess_env

from trainer import train
from trainer.atomic import is_temporary
from trainer.checkpointing import all_variables
from trainer.distribute import Distribution, is_chief, setup
from trainer.resume import find_latest
from trainer.save_backends import load_checkpoint

RTOL, ATOL = 1e-5, 1e-6
# No dropout where runs under different strategies are compared: each replica draws its
# own masks for its share of the batch, so dropout differs by design, not by rounding.
BASE = [*TINY, "model=mlp", "model.dropout=0"]
SAVEDMODEL = "save._target_=trainer.save_backends.savedmodel.SavedModelBackend"
BACKENDS = {"h5": "save=h5", "weights": "save=weights", "savedmodel": SAVEDMODEL}
MIRRORED = ["strategy=mirrored", "strategy.logical_cpus=2"]
SIGTERM_AT_4 = "+test_hooks=[{_target_: trainer.faults.SignalAtStep, step: 4}]"
CHILD_TIMEOUT = 240


def values(checkpoint_path: Path) -> tuple[list[np.ndarray], object]:
    checkpoint = load_checkpoint(checkpoint_path)
    return [np.asarray(v.numpy()) for v in all_variables(checkpoint.model)], checkpoint.state


def assert_close(got: list[np.ndarray], want: list[np.ndarray], *, exact: bool = False):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if exact or a.dtype.kind != "f":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def run_child(spec: dict, tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    child = [sys.executable, str(ROOT / "tests" / "distribute_child.py"), str(path)]
    result = subprocess.run(
        child, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
        timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]


def test_rules_without_a_strategy():
    dist = setup({"kind": "default", "scale_lr": True})
    assert dist.strategy is None and dist.num_replicas == 1 and dist.is_chief
    assert dist.lr_factor == 1.0 and dist.per_replica_batch(16) == 16
    assert Distribution(scale_lr=False).output_dir(Path("/x")) == Path("/x")
    assert is_chief("chief", 0) and not is_chief("worker", 1)
    with pytest.raises(Exception, match="strategy.kind"):
        setup({"kind": "tpu"})


@pytest.mark.slow
def test_mirrored_train_resume_and_load_across_strategies(compose_cfg, tmp_path):
    # One device: a straight run, and one stopped by SIGTERM in the middle of epoch 2.
    single, broken = tmp_path / "single", tmp_path / "broken"
    train(compose_cfg(*BASE, "save=weights", f"run_dir={single}"))
    train(compose_cfg(*BASE, "save=weights", f"run_dir={broken}", SIGTERM_AT_4))
    assert load_checkpoint(broken / "checkpoints" / "latest").state.global_step == 5

    dropout = [*TINY, "model=mlp", "model.dropout=0.3", "save=h5", *MIRRORED]
    jobs = [
        # A one-device checkpoint resumed under the strategy.
        [*BASE, *MIRRORED, "resume=latest", f"resume_dir={broken}"],
        # Every backend under the strategy.
        *([*BASE, *MIRRORED, flag, f"run_dir={tmp_path / name}"] for name, flag in BACKENDS.items()),
        # Interrupted and resumed under the strategy, with dropout (RNG state restored).
        [*dropout, f"run_dir={tmp_path / 'm_straight'}"],
        [*dropout, f"run_dir={tmp_path / 'm_broken'}", SIGTERM_AT_4],
        [*dropout, "resume=latest", f"resume_dir={tmp_path / 'm_broken'}"],
    ]  # fmt: skip
    x = compose_cfg(*BASE)  # the validation inputs, as the runs split them
    from hydra.utils import instantiate

    inputs = instantiate(x.data).x_val
    np.save(tmp_path / "x.npy", inputs)
    checkpoints = {name: str(tmp_path / name / "checkpoints" / "latest") for name in BACKENDS}
    checkpoints["single"] = str(single / "checkpoints" / "latest")
    spec = {
        "jobs": jobs,
        "strategy": [*BASE, *MIRRORED],
        "predict": {
            "inputs": str(tmp_path / "x.npy"),
            "checkpoints": checkpoints,
            "out": str(tmp_path / "predictions.npz"),
        },
    }
    run_child(spec, tmp_path)

    expected, expected_state = values(single / "checkpoints" / "latest")
    # One-device checkpoint, resumed under the strategy: continues as on one device.
    got, state = values(broken / "checkpoints" / "latest")
    assert state.global_step == expected_state.global_step == 6
    assert_close(got, expected)
    # Checkpoints written under the strategy load here (no strategy) and match.
    predictions = np.load(tmp_path / "predictions.npz")
    for name in BACKENDS:
        path = tmp_path / name / "checkpoints" / "latest"
        got, state = values(path)
        assert state.global_step == 6 and [h["epoch"] for h in state.extra["history"]] == [1, 2]
        assert_close(got, expected)
        # Loaded under the strategy (child) and without it (here): the same predictions.
        here = load_checkpoint(path).model.predict(inputs, verbose=0)
        np.testing.assert_allclose(predictions[name], here, rtol=1e-6, atol=1e-6)
    # A one-device checkpoint loaded under the strategy predicts as it does here.
    here = load_checkpoint(single / "checkpoints" / "latest").model.predict(inputs, verbose=0)
    np.testing.assert_allclose(predictions["single"], here, rtol=1e-6, atol=1e-6)
    # Same strategy, interrupted and resumed: bitwise the straight run.
    straight, straight_state = values(tmp_path / "m_straight" / "checkpoints" / "latest")
    resumed, resumed_state = values(tmp_path / "m_broken" / "checkpoints" / "latest")
    assert resumed_state.global_step == straight_state.global_step == 6
    assert_close(resumed, straight, exact=True)
    assert resumed_state.extra["history"] == straight_state.extra["history"]
