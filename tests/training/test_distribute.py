"""tf.distribute: MirroredStrategy on 2 logical CPUs and MultiWorkerMirroredStrategy with two
worker processes on 127.0.0.1, checkpoints across strategies, resume, worker cleanup.

Strategies need a fresh process (logical devices and collectives are configured before
TensorFlow initialises), so they run in children; the single-device runs and every check
run here, without any strategy. The tolerance of a comparison across strategies, and why:
``tests.helpers.distribute``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from hydra.utils import instantiate

from tests.helpers import warm
from tests.helpers.config import TINY
from tests.helpers.distribute import BASE, RTOL, assert_close, values
from tests.helpers.paths import CHILDREN_DIR, ROOT
from tests.helpers.processes import subprocess_env
from tests.helpers.workers import kill, start_workers, worker_logs
from trainer import train
from trainer.errors import ConfigError
from trainer.save_backends import get_backend, load_checkpoint, read_checkpoint_metadata
from trainer.storage.atomic import is_temporary
from trainer.tensorboard.links import resolve_link
from trainer.training.distribute import Distribution, is_chief, scaled_optimizer_cfg, setup
from trainer.training.resume import find_latest

SAVEDMODEL = "save._target_=trainer.save_backends.savedmodel.SavedModelBackend"
BACKENDS = {"h5": "save=h5", "weights": "save=weights", "savedmodel": SAVEDMODEL}
MIRRORED = ["strategy=mirrored", "strategy.logical_cpus=2"]
CHILD_TIMEOUT = 900  # hang guard, never a speed check


def sigterm_at(step: int) -> str:
    """SIGTERM to the training process after ``step``; it stops after the next batch."""
    return f"+callbacks.sigterm={{_target_: faults.SignalAtStep, step: {step}}}"


def run_child(spec: dict, tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    child = [sys.executable, str(CHILDREN_DIR / "distribute_child.py"), str(path)]
    result = warm.run(
        child, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
        timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]


def test_rules_without_a_strategy(tmp_path):
    dist = setup({"kind": "default", "scale_lr": True})
    assert dist.strategy is None and dist.num_replicas == 1 and dist.is_chief
    assert dist.lr_factor == 1.0 and dist.per_replica_batch(16) == 16
    run_dir = tmp_path / "run"  # output_dir locks it for the process: never a shared path
    assert Distribution(scale_lr=False).output_dir(run_dir) == run_dir
    assert is_chief("chief", 0) and not is_chief("worker", 1)
    with pytest.raises(Exception, match=r"strategy\.kind"):
        setup({"kind": "tpu"})


@pytest.mark.parametrize("count", [0, -1])
def test_a_logical_cpu_count_below_one_is_refused(count):
    """0 trained silently on the one CPU; -1 hid every CPU (a raw NotFoundError)."""
    for kind in ("mirrored", "multiworker"):
        with pytest.raises(ConfigError, match=r"strategy\.logical_cpus must be .* at least 1"):
            setup({"kind": kind, "logical_cpus": count})


def test_multiworker_without_tf_config_points_to_the_multi_worker_page(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ConfigError) as refused:
        setup({"kind": "multiworker"})
    message = str(refused.value)
    assert "(see docs/how-to/multi-worker.md)" in message and "README" not in message
    assert message.endswith("Received no TF_CONFIG")


@pytest.mark.parametrize("device", ["/gpu:7", "/cpu:3", "foo"])
def test_a_device_the_process_does_not_have_is_refused(device):
    """MirroredStrategy took a missing /gpu:7 and trained on the one CPU, silently."""
    with pytest.raises(ConfigError) as refused:
        setup({"kind": "mirrored", "devices": [device]})
    message = str(refused.value)
    assert f"strategy.devices names {device!r}" in message and "CPU:0" in message
    assert message.endswith(f"Received: strategy.devices={[device]}")


def test_train_py_exits_2_for_a_missing_device(tmp_path):
    result = warm.run(
        [sys.executable, str(ROOT / "train.py"), *BASE, "strategy=mirrored",
         "strategy.devices=[/gpu:7]", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
        timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: strategy.devices names '/gpu:7'" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_learning_rate_scaling_is_opt_in(compose_cfg):
    cfg = compose_cfg("optimizer=sgd")
    assert scaled_optimizer_cfg(cfg.optimizer, 1.0) is cfg.optimizer
    scaled = scaled_optimizer_cfg(cfg.optimizer, 4.0)
    assert scaled.learning_rate == pytest.approx(4 * cfg.optimizer.learning_rate)
    assert scaled.momentum == cfg.optimizer.momentum
    assert cfg.optimizer.learning_rate == 0.05  # the run's config is left alone
    assert Distribution(scale_lr=True).lr_factor == 1.0  # one replica: nothing to scale


def test_non_chief_writes_only_into_its_scratch_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}))
    stale = tmp_path / ".worker-1.tmp-1-dead"  # left by a killed run of the same worker
    stale.mkdir()
    worker = Distribution(kind="multiworker", task_type="worker", task_id=1)
    assert not worker.is_chief and Distribution(task_type="worker", task_id=0).is_chief
    scratch = worker.output_dir(tmp_path)
    assert scratch.parent == tmp_path and is_temporary(scratch) and not stale.exists()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    backend = worker.backend(get_backend("h5"))
    written = backend.save(model, scratch / "checkpoints" / "step-1")
    assert written.name == "step-1.h5" and backend.name == "h5"
    assert not written.exists()  # removed right after the write
    worker.cleanup()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_mirrored_train_resume_and_load_across_strategies(compose_cfg, tmp_path):
    # One device: a straight run, and one stopped by SIGTERM after step 2 of 6.
    single, broken = tmp_path / "single", tmp_path / "broken"
    train(compose_cfg(*BASE, "save=weights", f"run_dir={single}"))
    train(compose_cfg(*BASE, "save=weights", f"run_dir={broken}", sigterm_at(1)))
    assert load_checkpoint(broken / "checkpoints" / "latest").state.global_step == 2

    # Under the strategy with dropout, so the RNG seed states go through every backend too.
    dropout = [*TINY, "model=mlp", "model.dropout=0.3", *MIRRORED]
    uneven = tmp_path / "uneven"
    jobs = [
        # The one-device checkpoint, resumed under the strategy for its last 4 steps.
        [*BASE, *MIRRORED, "resume=latest", f"resume_dir={broken}"],
        *([*dropout, flag, f"run_dir={tmp_path / name}"] for name, flag in BACKENDS.items()),
        # Interrupted in the middle of epoch 2 and resumed, under the strategy.
        [*dropout, "save=h5", f"run_dir={tmp_path / 'm_broken'}", sigterm_at(4)],
        [*dropout, "save=h5", "resume=latest", f"resume_dir={tmp_path / 'm_broken'}"],
        # A validation set (51 examples) smaller than the global batch, split 26/25.
        [*BASE, *MIRRORED, "trainer.batch_size=64", "save=weights", f"run_dir={uneven}"],
    ]  # fmt: skip
    inputs = instantiate(compose_cfg(*BASE).data).x_val
    np.save(tmp_path / "x.npy", inputs)
    checkpoints = {name: str(tmp_path / name / "checkpoints" / "latest") for name in BACKENDS}
    checkpoints["single"] = str(single / "checkpoints" / "latest")
    spec = {
        "jobs": jobs,
        "strategy": [*BASE, *MIRRORED],
        "canary": str(tmp_path / "canary.json"),
        "predict": {
            "inputs": str(tmp_path / "x.npy"),
            "checkpoints": checkpoints,
            "out": str(tmp_path / "predictions.npz"),
        },
    }
    run_child(spec, tmp_path)

    # The one-device checkpoint resumed under the strategy continues as on one device.
    expected, expected_state = values(single / "checkpoints" / "latest")
    got, state = values(broken / "checkpoints" / "latest")
    assert state.global_step == expected_state.global_step == 6
    assert_close(got, expected)
    assert [h["epoch"] for h in state.history] == [1, 2]

    # Checkpoints written under the strategy load here, without it: every backend holds
    # the same values, and predicts as the same checkpoint loaded under the strategy.
    predictions = np.load(tmp_path / "predictions.npz")
    reference, reference_state = values(tmp_path / "h5" / "checkpoints" / "latest")
    assert reference_state.global_step == 6
    for name in BACKENDS:
        path = tmp_path / name / "checkpoints" / "latest"
        got, state = values(path)
        assert_close(got, reference, exact=True)
        assert state.history == reference_state.history
        here = load_checkpoint(path).model.predict(inputs, verbose=0)
        np.testing.assert_allclose(predictions[name], here, rtol=1e-6, atol=1e-6)
    # ... and a one-device checkpoint loaded under the strategy predicts as it does here.
    here = load_checkpoint(single / "checkpoints" / "latest").model.predict(inputs, verbose=0)
    np.testing.assert_allclose(predictions["single"], here, rtol=1e-6, atol=1e-6)

    # Plain Keras 3.15 fails on a first batch split unevenly over the replicas (the canary:
    # drop the workaround once it passes); trainer trains through it, and the last epoch's
    # validation loss is what the final weights give on the whole validation set.
    canary = json.loads((tmp_path / "canary.json").read_text())
    assert "AddN" in (canary["error"] or ""), canary
    _, state = values(uneven / "checkpoints" / "latest")
    assert state.global_step == 6
    model = load_checkpoint(uneven / "checkpoints" / "latest").model
    val_y = instantiate(compose_cfg(*BASE).data).y_val
    loss = model.evaluate(inputs, val_y, batch_size=64, verbose=0, return_dict=True)["loss"]
    np.testing.assert_allclose(state.history[-1]["val_loss"], loss, rtol=1e-5)

    # Same strategy, interrupted mid-epoch and resumed: bitwise the straight run.
    resumed, resumed_state = values(tmp_path / "m_broken" / "checkpoints" / "latest")
    assert resumed_state.global_step == 6
    assert_close(resumed, reference, exact=True)
    assert resumed_state.history == reference_state.history


# ----------------------------------------------------------------------- multi-worker
WORKER_TIMEOUT = 900  # hang guard for a phase of two workers, never a speed check
STEPS = 9  # 3 epochs of 3 steps


def read_step(path: Path) -> int:
    return read_checkpoint_metadata(path)["state"]["global_step"]


def latest_step(directory: Path) -> int:
    """The newest complete checkpoint's step, from its metadata: a probe of the workers'
    progress, polled while they run. Loading the whole model took seconds on a loaded
    machine, long enough for a fast run to finish unobserved; the loads are checked
    after the kill."""
    try:
        return read_checkpoint_metadata(find_latest(directory))["state"]["global_step"]
    except Exception:  # nothing complete yet
        return -1


@pytest.mark.slow
def test_multiworker_checkpoints_kill_resume_and_stop_together(compose_cfg, tmp_path):
    run = tmp_path / "run"
    config = [*BASE, "trainer.epochs=3", "checkpoint.policy.every_n_steps=1", f"run_dir={run}"]
    # Every save sleeps 1 s (after writing, before publishing) so the kill lands mid-run.
    slow = ["save=weights", "save._target_=faults.slow_backend", "+save.delay=1.0"]
    workers = start_workers([*config, *slow], tmp_path, "first")
    pids = [workers[1].pid]
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT
        while latest_step(run / "checkpoints") < 3:
            crashed = [w.returncode for w in workers if w.poll() is not None]
            assert not crashed, f"a worker exited: {crashed}\n{worker_logs(tmp_path, 'first')}"
            assert time.monotonic() < deadline, worker_logs(tmp_path, "first")
            time.sleep(0.2)
    finally:
        kill(workers)  # SIGKILL both: no cleanup of any kind runs
    killed_at = latest_step(run / "checkpoints")
    assert 3 <= killed_at <= 6

    # Every checkpoint the chief published is complete and loads without a strategy.
    for path in (run / "checkpoints").iterdir():
        if path.name != "latest" and not is_temporary(path):
            assert load_checkpoint(path).state.global_step == int(path.name.split("-")[-1])

    # The one-device reference, keeping every checkpoint (while no worker runs).
    single = tmp_path / "single"
    reference = [*BASE, "trainer.epochs=3", "checkpoint.policy.every_n_steps=1", "save=weights"]
    train(compose_cfg(*reference, "checkpoint.policy.keep_last=null", f"run_dir={single}"))

    # Resume both; only worker 1 gets SIGTERM (after step 7): both stop after step 8, the
    # chief saves the interrupt checkpoint, and both exit cleanly instead of hanging.
    workers = start_workers(
        [*config, "save=weights", "resume=latest", f"resume_dir={run}"],
        tmp_path,
        "resumed",
        only_worker1=(sigterm_at(7),),
    )
    pids.append(workers[1].pid)
    try:
        for worker in workers:
            worker.wait(timeout=WORKER_TIMEOUT)
    finally:
        kill(workers)
    assert [w.returncode for w in workers] == [0, 0], worker_logs(tmp_path, "resumed")

    # The resumed, interrupted run holds what the one-device run held after step 8.
    got, state = values(run / "checkpoints" / "latest")
    expected, expected_state = values(single / "checkpoints" / "step-00000008")
    assert (state.epoch, state.step_in_epoch, state.global_step) == (2, 2, 8)
    assert_close(got, expected)
    for mine, theirs in zip(state.history, expected_state.history, strict=True):
        assert mine == pytest.approx(theirs, rel=RTOL)

    # The chief's checkpoints link to the chief's own event files, which hold their cards.
    for path in (run / "checkpoints").iterdir():
        if path.name != "latest":
            link = resolve_link(path, read_checkpoint_metadata(path))
            assert link.run_dir == run and link.step == read_step(path)

    # Nothing left by the non-chief worker, nor by the killed writes; the chief records its
    # sessions of the run in .hydra/sessions (issue 16 item 15).
    hidden = [p.name for p in run.iterdir() if p.name.startswith(".")]
    assert hidden in ([], [".hydra"]), hidden
    if hidden:
        assert [p.name for p in (run / ".hydra").iterdir()] == ["sessions"]
    assert not [p for p in (run / "checkpoints").iterdir() if is_temporary(p)]
    # Only the chief wrote events: one session mark per chief start, no worker event file.
    events = [p.name for p in (run / "tb").iterdir()]
    assert len([n for n in events if "+session" in n]) == 2
    assert not [n for n in events for pid in pids if f".{pid}." in n]
