"""Bad values are refused before anything is written, naming the key (found by a probe of
the entry points): a checkpoint name holding a path overwrote another run's checkpoints; a
damaged checkpoint was skipped by resume and then trained over; other values ended in raw
errors or were silently accepted."""

from __future__ import annotations

import collections
from pathlib import Path

import keras
import pytest

from trainer import train
from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.errors import ConfigError, CorruptCheckpointError
from trainer.save_backends import load_checkpoint


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"name": "../../other-run/checkpoints/step-{step:08d}"}, "without a path"),
        ({"name": "sub/{step}"}, "without a path"),
        ({"name": ".ck-{step}"}, "must not start with '.'"),
        ({"name": "latest"}, "must not be 'latest'"),
        ({"name": ""}, "plain file name"),
        ({"keep_last": 2.5}, "keep_last must be an integer"),
        ({"keep_last": "3"}, "keep_last must be an integer"),
        ({"async_save": "no"}, "async_save must be true or false"),
        ({"keep_best": -1}, "keep_best must be 0"),
        ({"mode": "lowest"}, "checkpoint.policy.mode"),
    ],
)
def test_policy_values_no_save_could_use_are_refused(options, said):
    with pytest.raises(ConfigError, match=said):
        CheckpointPolicy(**options)


def test_a_monitor_no_save_logs_is_refused_before_training():
    policy = CheckpointPolicy(monitor="val_los")
    with pytest.raises(ConfigError, match="'val_los' is not a metric this run logs"):
        policy.check_name(["loss", "accuracy"], validation=True)
    CheckpointPolicy(monitor="val_accuracy").check_name(["loss", "accuracy"], validation=True)
    CheckpointPolicy(monitor="val_los", keep_best=0).check_name(["loss"], validation=True)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["trainer.batch_size=0"], "trainer.batch_size must be a whole number of at least 1"),
        (["trainer.batch_size=-4"], "trainer.batch_size"),
        (["trainer.epochs=-1"], "trainer.epochs"),
        (["trainer.steps_per_epoch=-1"], "trainer.steps_per_epoch"),
        (["resume=true"], "resume must be a string"),
        (["resume=1"], "resume must be a string"),
        (["resume_dir=/somewhere"], "resume_dir is set but resume is not"),
        (["checkpoint.policy.name='../x-{step}'"], "without a path"),
        (["save._target_=collections.OrderedDict"], "save._target_ must build a save backend"),
        # Found by a probe: raw ValueErrors (exit 1), or gradient ascent trained to the end.
        (["seed=abc"], "seed must be a whole number"),
        (["seed=-1"], "seed must be a whole number"),
        (["optimizer.learning_rate=abc"], "optimizer.learning_rate must be a number above 0"),
        (["optimizer.learning_rate=-1"], "optimizer.learning_rate must be a number above 0"),
        (["wrap=prune", "wrap.target_sparsity=1.5"], "wrap.target_sparsity"),
        (["wrap=prune", "wrap.frequency=0"], "wrap.frequency"),
    ],
)
def test_run_values_are_refused_before_anything_is_written(compose_cfg, overrides, said):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError, match=said):
        train(cfg)
    assert not (Path(cfg.run_dir) / "checkpoints").exists()


def test_manager_arguments_of_the_wrong_type_are_refused(tmp_path):
    for kwargs, said in [
        ({"backend": object()}, "backend must be a backend name"),
        ({"policy": {"keep_last": 2}}, "policy must be a CheckpointPolicy"),
        ({"metadata": ["x"]}, "metadata must be a dict"),
    ]:
        with pytest.raises(ConfigError, match=said):
            CheckpointManager(tmp_path / "ckpt", **kwargs)
    with pytest.raises(ConfigError, match="directory must be a path"):
        CheckpointManager(None)
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    with (
        CheckpointManager(tmp_path / "ckpt", backend="h5") as manager,
        pytest.raises(ConfigError, match=r"state must be a trainer\.state\.TrainingState"),
    ):
        manager.save(model, state=collections.OrderedDict(global_step=1))


# The damaged-checkpoint runs: an MLP, since the checks are about which checkpoint files a
# resume skips, keeps and writes (a flipped byte is caught by the manifest's checksum of the
# whole file, whatever the model); the default ResNet cost ~4x the CPU.
DAMAGED_RUN = ("model=mlp",)


def _checkpoints(cfg) -> list[Path]:
    return sorted(p for p in (Path(cfg.run_dir) / "checkpoints").iterdir() if "step-" in p.name)


def _target(backend: str, checkpoint: Path, how: str) -> Path:
    """The file ``_damage`` damages: the variable values or the metadata."""
    if backend == "h5":
        return checkpoint
    if how == "values":
        if backend == "weights":
            return checkpoint / "model.weights.h5"
        return checkpoint / "variables" / "variables.data-00000-of-00001"
    if backend == "weights":
        return checkpoint / "trainer.json"
    return checkpoint / "assets.extra" / "trainer_metadata.json"


def _damage(backend: str, checkpoint: Path, how: str) -> bytes:
    """Damage ``checkpoint``: one byte of its variable values flipped behind the manifest's
    back ("values"), or its metadata garbled ("metadata"); returns the damaged content."""
    target = _target(backend, checkpoint, how)
    data = bytearray(target.read_bytes())
    if how == "values":
        data[len(data) * 2 // 3] ^= 0xFF
    elif backend == "h5":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"{garbled")
    target.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize(
    ("backend", "how"),
    [("h5", "values"), ("savedmodel", "values"), ("weights", "metadata")],
)
def test_resume_skips_a_damaged_newest_checkpoint_and_keeps_it(compose_cfg, backend, how, caplog):
    """Issue 36: resume=auto after the newest checkpoint was damaged continues from the one
    before, with a warning naming the damaged one and why. The damaged checkpoint is moved
    aside whole (abandoned-1/), never deleted or trained over. Before, damaged values were
    loaded silently (h5, weights) and damaged metadata refused the whole resume."""
    cfg = compose_cfg(*DAMAGED_RUN, f"save={backend}", "trainer.epochs=2")
    train(cfg)
    newest = _checkpoints(cfg)[-1]
    content = _damage(backend, newest, how)
    again = compose_cfg(*DAMAGED_RUN, f"save={backend}", "trainer.epochs=4", "resume=auto")
    with caplog.at_level("WARNING"):
        train(again)
    assert f"Skipping damaged checkpoint {newest}" in caplog.text
    kept = Path(cfg.run_dir) / "checkpoints" / "abandoned-1" / newest.name
    assert _target(backend, kept, how).read_bytes() == content
    # From step 3 on: step 6 written again (whole), then 9 and 12; retention keeps 3.
    names = [p.name.removesuffix(".h5") for p in _checkpoints(cfg)]
    assert names == ["step-00000006", "step-00000009", "step-00000012"]
    assert load_checkpoint(Path(cfg.run_dir) / "checkpoints" / newest.name).state.global_step == 6


@pytest.mark.parametrize("backend", ["h5"])
def test_resume_refuses_when_every_checkpoint_is_damaged(compose_cfg, backend):
    """With every checkpoint damaged there is nothing to resume from; resume=auto must not
    start afresh over them (it replaced them all once)."""
    cfg = compose_cfg(*DAMAGED_RUN, f"save={backend}", "trainer.epochs=2")
    train(cfg)
    checkpoints = _checkpoints(cfg)
    damage = list(zip(checkpoints, ["values", "metadata"] * len(checkpoints), strict=False))
    contents = [_damage(backend, checkpoint, how) for checkpoint, how in damage]
    for resume in ("latest", "auto"):
        again = compose_cfg(*DAMAGED_RUN, f"save={backend}", "trainer.epochs=4", f"resume={resume}")
        with pytest.raises(CorruptCheckpointError, match=r"Every checkpoint in .* is damaged"):
            train(again)
    assert [_target(backend, c, how).read_bytes() for c, how in damage] == contents


def test_checkpoint_track_must_name_its_callbacks(tmp_path):
    from trainer.checkpointing import Checkpoint

    with pytest.raises(ConfigError, match="track must be a dict naming each callback"):
        Checkpoint(directory=tmp_path / "ckpt", track=[keras.callbacks.EarlyStopping()])


def test_a_json_command_that_fails_still_prints_json(tmp_path, capsys):
    import json

    from trainer.cli.app import main

    damaged = tmp_path / "ckpt.h5"
    damaged.write_bytes(b"not a checkpoint")
    assert main(["verify", str(damaged), "--json"]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["ok"] is False and report["error"] and captured.err.startswith("error: ")
