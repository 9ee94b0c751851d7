"""Exact resume, checkpoint policies and faults: the checkpoint callback end to end."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.helpers import warm
from tests.helpers.checkpoints import list_checkpoints
from tests.helpers.config import TINY, compose_run, config_options
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer import train
from trainer.checkpointing import AsyncWriter, CheckpointPolicy, all_variables, retained
from trainer.errors import ConfigMismatchError, NotACheckpointError, SaveError
from trainer.save_backends import load_checkpoint, read_checkpoint_metadata
from trainer.training.resume import find_latest

# A Dropout model, three epochs of three steps each, a checkpoint every step.
EXACT = [
    "model=mlp",
    "model.dropout=0.3",
    "trainer.epochs=3",
    "checkpoint.policy.every_n_steps=1",
    "checkpoint.policy.keep_last=2",
]


def final_values(run_dir):
    checkpoint = load_checkpoint(run_dir / "checkpoints" / "latest")
    values = [np.asarray(v.numpy()) for v in all_variables(checkpoint.model)]
    return values, checkpoint.state


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The run never stopped, once for every backend's test (training does not depend on
    the backend: the weights backend's run is the reference the others must match bitwise,
    which is stricter than each backend matching a run saved through itself)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(compose_run(run, *EXACT, "save=weights"))
    return final_values(run)


@pytest.mark.slow
@pytest.mark.parametrize("save", config_options("save"))
def test_stop_mid_epoch_and_resume_is_bitwise_exact(compose_cfg, tmp_path, save, straight_run):
    expected, expected_state = straight_run

    # SIGTERM to ourselves after global step 4; training stops after the batch in flight
    # (step 5), in the middle of epoch 2 (3 steps per epoch).
    broken = tmp_path / "broken"
    hook = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}"
    train(compose_cfg(*EXACT, f"save={save}", f"run_dir={broken}", hook))
    interrupted = load_checkpoint(broken / "checkpoints" / "latest").state
    assert (interrupted.epoch, interrupted.step_in_epoch, interrupted.global_step) == (1, 2, 5)

    resumed_cfg = compose_cfg(*EXACT, f"save={save}", "resume=latest", f"resume_dir={broken}")
    train(resumed_cfg)
    actual, actual_state = final_values(broken)
    assert actual_state.global_step == expected_state.global_step == 9
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert actual_state.history == expected_state.history
    assert [h["epoch"] for h in actual_state.history] == [1, 2, 3]


def test_resume_refuses_a_different_architecture(compose_cfg, tmp_path):
    run = tmp_path / "run"
    train(compose_cfg("model=mlp", "save=h5", "trainer.epochs=1"))
    cfg = compose_cfg(
        "model=mlp", "model.hidden=[32]", "save=h5", "resume=latest", f"resume_dir={run}"
    )
    with pytest.raises(ConfigMismatchError, match=r"model\.hidden"):
        train(cfg)


def test_resume_refuses_turning_learning_rate_scaling_on(compose_cfg, tmp_path):
    """Found by a probe: resumed with ``strategy=mirrored strategy.scale_lr=true``, a
    constant rate came back unscaled from the optimizer's variable while a schedule's was
    scaled: the resumed run trained at neither the old nor the configured rate."""
    run = tmp_path / "run"
    base = ("model=mlp", "save=h5", "schedule=none")
    train(compose_cfg(*base, "trainer.epochs=1"))
    cfg = compose_cfg(
        *base,
        "trainer.epochs=2",
        "strategy=mirrored",
        "strategy.scale_lr=true",
        "resume=latest",
        f"resume_dir={run}",
    )
    with pytest.raises(ConfigMismatchError, match=r"strategy\.scale_lr"):
        train(cfg)


def test_resume_allows_more_epochs(compose_cfg, tmp_path):
    run = tmp_path / "run"
    train(compose_cfg("model=mlp", "save=h5", "trainer.epochs=1"))
    train(
        compose_cfg(
            "model=mlp", "save=h5", "trainer.epochs=2", "resume=latest", f"resume_dir={run}"
        )
    )
    state = load_checkpoint(run / "checkpoints" / "latest").state
    assert (state.epoch, state.global_step) == (2, 6)


def test_resume_latest_with_nothing_there_is_a_clear_error(compose_cfg, tmp_path):
    with pytest.raises(NotACheckpointError, match="no complete checkpoint"):
        train(compose_cfg("save=h5", "resume=latest", f"resume_dir={tmp_path}"))


def test_retention_keeps_last_best_and_every_mth():
    policy = CheckpointPolicy(keep_last=2, keep_best=1, monitor="val_loss", keep_every_n_epochs=2)
    records = [
        {"name": f"c{e}", "step": e * 10, "epoch": e, "epoch_end": True, "monitor": loss}
        for e, loss in [(1, 0.9), (2, 0.2), (3, 0.5), (4, 0.6), (5, 0.7), (6, 0.8)]
    ]
    # last two (c5, c6), best (c2), every 2nd epoch (c2, c4, c6)
    assert retained(records, policy) == {"c2", "c4", "c5", "c6"}
    maximise = CheckpointPolicy(keep_last=1, keep_best=1, mode="max")
    assert retained(records, maximise) == {"c1", "c6"}


def test_newest_is_kept_even_when_worse():
    policy = CheckpointPolicy(keep_last=1, keep_best=1)
    records = [
        {"name": "good", "step": 1, "epoch": 1, "epoch_end": True, "monitor": 0.1},
        {"name": "newest", "step": 2, "epoch": 2, "epoch_end": True, "monitor": 9.0},
    ]
    assert retained(records, policy) == {"good", "newest"}


def test_retention_on_disk(compose_cfg, tmp_path):
    cfg = compose_cfg(
        "model=mlp",
        "save=h5",
        "trainer.epochs=4",
        "checkpoint.policy.keep_last=2",
        "checkpoint.policy.keep_best=0",
    )
    train(cfg)
    names = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-00000009.h5", "step-00000012.h5"]


def test_policy_rejects_bad_values():
    with pytest.raises(ValueError, match=r"checkpoint\.policy\.mode"):
        CheckpointPolicy(mode="up")
    with pytest.raises(ValueError, match="every_n_steps"):
        CheckpointPolicy(every_n_steps=0)


def test_async_failure_is_raised_not_swallowed():
    writer = AsyncWriter()

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.submit(lambda: None)  # the next save reports the earlier failure
    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()  # and so does the end of training


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_failed_save_raises_and_keeps_previous(compose_cfg, tmp_path, async_save):
    """A real OS error during the save (a name the filesystem refuses: ENAMETOOLONG)."""
    run = tmp_path / "run"
    train(compose_cfg("model=mlp", "save=weights", "trainer.epochs=1"))
    (before,) = list_checkpoints(run / "checkpoints")
    cfg = compose_cfg("model=mlp", "save=weights", "trainer.epochs=2", "resume=latest",
                      f"resume_dir={run}", f"checkpoint.policy.async_save={async_save}",
                      "checkpoint.policy.name='" + "x" * 300 + "{step}'")  # fmt: skip
    # (Keras' traceback filter drops __cause__ when the error passes through fit.)
    with pytest.raises(SaveError, match=r"previous checkpoints.*Received error type OSError"):
        train(cfg)
    assert list_checkpoints(run / "checkpoints") == [before]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert load_checkpoint(run / "checkpoints" / "latest").state.epoch == 1


def _train_cmd(run_dir, *extra):
    return [
        sys.executable, str(ROOT / "train.py"), "model=mlp", "data=synthetic",
        "trainer.verbose=0", "trainer.batch_size=16", f"hydra.run.dir={run_dir}",
        "hydra/job_logging=disabled", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    run = tmp_path / "run"
    proc = warm.Popen(
        _train_cmd(run, "trainer.epochs=200", "save=h5", "hydra/job_logging=default"),
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 900  # hang guard only
    while not list_checkpoints_safe(run / "checkpoints"):
        assert proc.poll() is None, "the trainer exited before its first checkpoint"
        assert time.monotonic() < deadline, "hung: no checkpoint was written"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-2000:]
    # The hint repeats the run's own overrides (tests/workflows/test_resume.py runs it).
    assert "resume with: python train.py model=mlp data=synthetic" in output
    assert f"resume=latest resume_dir={run}" in output
    state = load_checkpoint(run / "checkpoints" / "latest").state
    assert 0 < state.epoch < 200


def list_checkpoints_safe(directory):
    return list_checkpoints(directory) if directory.is_dir() else []


# One run of 4 SIGKILLs aimed at saves (slowed down to widen the window); the kills at any
# moment of a whole run, every backend (20 of them), are in tests/workflows/test_crash_anywhere.py.
# 4, not 6: the suite's 20-minute budget (each kill costs a TensorFlow start-up).
KILLS_PER_RUN = 4


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7])
def test_sigkill_during_saves_never_leaves_a_loadable_partial(tmp_path, seed):
    """SIGKILLs at varied moments, many while a checkpoint is being written (each write
    sleeps 0.3 s before its rename); each restart resumes from the newest complete one."""
    rng = np.random.default_rng(seed)
    run = tmp_path / "run"
    slow = [
        "save=weights",
        "save._target_=faults.slow_backend",
        "+save.inner=weights",
        "+save.delay=0.3",
    ]
    policy = ["checkpoint.policy.every_n_steps=2", "checkpoint.policy.keep_last=2"]
    kills = resumed_steps = 0
    previous_step = -1
    while kills < KILLS_PER_RUN:
        resume = ["resume=latest"] if list_checkpoints_safe(run / "checkpoints") else []
        proc = warm.Popen(
            _train_cmd(run, "trainer.epochs=1000", *slow, *policy, *resume),
            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wrote = False
        try:  # a failing poll must not leave the trainer running (it trained on for minutes)
            wrote = _wait_for_new_checkpoint(run, proc, previous_step)
        finally:
            if not wrote:
                proc.kill()
                proc.wait()
        if not wrote:  # killing now would test nothing new: say what happened instead
            pytest.fail(f"no new checkpoint within 120 s (exit code {proc.returncode})")
        time.sleep(rng.uniform(0.0, 1.2))
        proc.kill()
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the trainer died before it was killed"
        kills += 1
        latest = find_latest(run / "checkpoints")
        checkpoint = load_checkpoint(latest)  # always complete and loadable
        assert checkpoint.state.global_step >= previous_step
        previous_step = checkpoint.state.global_step
        resumed_steps += 1
    assert kills == KILLS_PER_RUN and previous_step > 0
    # A partial write may be left as a hidden temporary; it is never a candidate, and the
    # next start removes it.
    final = warm.run(
        _train_cmd(run, f"trainer.epochs={2 + previous_step // 13}", *slow, *policy,
                   "resume=latest"),
        env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert final.returncode == 0, final.stderr[-2000:]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def _wait_for_new_checkpoint(run, proc, previous_step) -> bool:
    """Whether ``proc`` wrote a checkpoint newer than ``previous_step`` within 120 s."""
    start = time.monotonic()
    while time.monotonic() - start < 120 and proc.poll() is None:  # a hang guard
        newest = _newest_step(run)
        if newest is not None and newest > previous_step:
            return True
        time.sleep(0.05)
    return False


def _newest_step(run):
    """Cheap poll: the step recorded in the newest checkpoint's metadata (no model built)."""
    try:
        latest = find_latest(run / "checkpoints")
        return read_checkpoint_metadata(latest)["state"]["global_step"]
    except (NotACheckpointError, FileNotFoundError):
        return None


def test_resumed_curves_have_no_duplicate_steps(compose_cfg, tmp_path):
    """Resuming from an older checkpoint re-trains steps 4-6; TensorBoard shows each once."""
    # The accumulator the TensorBoard server itself uses (it purges tensor summaries too).
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(compose_cfg("model=mlp", "save=h5", "checkpoint.policy.keep_last=null"))
    older = run / "checkpoints" / "step-00000003.h5"
    train(compose_cfg("model=mlp", "save=h5", f"resume={older}"))
    events = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    steps = [event.step for event in events.Tensors("batch/loss")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_mid_epoch_stop_writes_no_epoch_point_of_its_own(compose_cfg, tmp_path):
    """Keras ends an epoch stopped by SIGTERM with the partial epoch's means and a validation
    of mid-epoch weights. Written at the stop's step, TensorBoard kept that point beside the
    resumed epoch's (found by a probe: an extra ``epoch/val_loss`` point in every backend)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    run = tmp_path / "run"
    hook = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}"
    train(compose_cfg(*EXACT, "save=h5", hook))
    train(compose_cfg(*EXACT, "save=h5", "resume=latest", f"resume_dir={run}"))
    events = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    for tag in ("epoch/loss", "epoch/val_loss", "epoch/learning_rate"):
        assert [event.step for event in events.Tensors(tag)] == [3, 6, 9], tag
    assert [event.step for event in events.Tensors("batch/loss")] == list(range(1, 10))


def test_resume_finds_a_custom_checkpoint_directory(compose_cfg, tmp_path):
    run = tmp_path / "run"
    custom = ["model=mlp", "save=h5", "checkpoint.directory=saved/ckpt"]
    train(compose_cfg(*custom, "trainer.epochs=1"))
    train(compose_cfg(*custom, "trainer.epochs=2", "resume=latest", f"resume_dir={run}"))
    state = load_checkpoint(run / "saved" / "ckpt" / "latest").state
    assert (state.epoch, state.global_step) == (2, 6)
    assert not (run / "checkpoints").exists()


def test_restore_into_a_fresh_model_carries_frozen_layers_and_their_slots(tmp_path):
    """Resuming into the model built from the config (every layer trainable, a fresh
    optimizer) after a layer was frozen mid-run: the layer comes back frozen and the
    optimizer is built for the variables it was saved for, so training goes on alike."""

    from trainer.model_state import trainable
    from trainer.save_backends import get_backend
    from trainer.training.resume import restore_into

    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(3, name="base"), keras.layers.Dense(1)]
        )
        model.compile(optimizer="adam", loss="mse")
        return model

    x = np.random.default_rng(5).normal(size=(16, 3)).astype("float32")
    model = build()
    model.fit(x, x[:, :1], epochs=1, shuffle=False, verbose=0)
    model.get_layer("base").trainable = False
    model.compile(optimizer=model.optimizer, loss="mse")
    path = get_backend("weights").save(model, tmp_path / "ckpt")
    fresh = build()
    restore_into(fresh, load_checkpoint(path))
    assert not fresh.get_layer("base").trainable
    assert trainable.optimizer_built_for(fresh) == trainable.optimizer_built_for(model)
    for each in (model, fresh):
        each.fit(x, x[:, :1], epochs=1, shuffle=False, verbose=0)
    for mine, theirs in zip(all_variables(model), all_variables(fresh), strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_restore_into_a_model_with_other_layers_refuses_only_a_frozen_state(tmp_path):
    """Variables restored into a model with a layer added that holds none: nothing to carry
    while every layer is trainable; with a frozen layer, the flags cannot be mapped and the
    restore is refused before any variable is assigned."""

    from trainer.save_backends import get_backend
    from trainer.training.resume import restore_into

    def build(extra: bool):
        keras.utils.set_random_seed(6)
        layers = [keras.layers.Dense(3, name="base")]
        layers += [keras.layers.Activation("relu")] if extra else []
        model = keras.Sequential([keras.Input((3,)), *layers, keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    x = np.random.default_rng(6).normal(size=(8, 3)).astype("float32")
    model = build(extra=False)
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    plain = get_backend("weights").save(model, tmp_path / "plain")
    other = build(extra=True)
    restore_into(other, load_checkpoint(plain))
    np.testing.assert_array_equal(other.layers[0].kernel.numpy(), model.layers[0].kernel.numpy())
    model.get_layer("base").trainable = False
    frozen = get_backend("weights").save(model, tmp_path / "frozen")
    other = build(extra=True)
    before = other.layers[0].kernel.numpy()
    with pytest.raises(ConfigMismatchError, match=r"layers \['base'\] were frozen"):
        restore_into(other, load_checkpoint(frozen))
    np.testing.assert_array_equal(other.layers[0].kernel.numpy(), before)


def test_restore_into_carries_weight_decay_exclusions_or_refuses_other_ones(tmp_path):

    from trainer.model_state import trainable
    from trainer.save_backends import get_backend
    from trainer.training.resume import restore_into

    def build(excluded: list[str] | None):
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
        if excluded:
            optimizer.exclude_from_weight_decay(var_names=excluded)
        model.compile(optimizer=optimizer, loss="mse")
        return model

    x = np.random.default_rng(7).normal(size=(8, 3)).astype("float32")
    model = build(["bias"])
    model.fit(x, x[:, :1], epochs=1, shuffle=False, verbose=0)
    checkpoint = load_checkpoint(get_backend("h5").save(model, tmp_path / "ckpt"))
    fresh = build(None)  # the optimizer not built yet: it takes the checkpoint's choice
    restore_into(fresh, checkpoint)
    assert trainable.no_weight_decay(fresh) == trainable.no_weight_decay(model) == [1, 3]
    built = build(["kernel"])
    built.fit(x, x[:, :1], epochs=1, shuffle=False, verbose=0)  # built: it cannot change
    with pytest.raises(ConfigMismatchError, match="out of weight decay"):
        restore_into(built, checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("save", ["savedmodel", "h5"])
def test_training_that_diverges_stops_and_keeps_its_finite_checkpoints(tmp_path, save):
    """Issue 39, item 2: a run whose weights became NaN trained on, saved NaN checkpoints
    and let retention delete the finite ones. Now `python train.py` stops at the first save
    after the loss turned NaN, exits 2 naming the newest finite checkpoint, and every
    checkpoint left is finite."""
    run = tmp_path / "run"
    hook = "+callbacks.poison={_target_: faults.PoisonAtEpoch, epoch: 3}"
    tiny = [o for o in TINY if not o.startswith("trainer.epochs=")]
    command = [sys.executable, str(ROOT / "train.py"), *tiny, f"save={save}", "model=mlp"]
    command += ["trainer.epochs=6", "checkpoint.policy.keep_last=2", hook, f"hydra.run.dir={run}"]
    result = warm.run(
        command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Training diverged: the loss became NaN or infinite by epoch" in result.stderr
    kept = list_checkpoints(run / "checkpoints")
    assert [p.name.removesuffix(".h5") for p in kept] == ["step-00000006", "step-00000009"]
    assert f"the newest finite one is {kept[-1]}" in result.stderr
    for path in kept:
        weights = load_checkpoint(path).model.get_weights()
        assert all(np.isfinite(w).all() for w in weights), path
