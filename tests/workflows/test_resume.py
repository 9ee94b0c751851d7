"""The resume workflow of ``python train.py`` (issue 16 items 1, 2, 3, 5, 12, 14, 16).

Real ``train.py`` processes with real signals where the entry point is under test; the
checks that need no process boundary run in-process. Tiny runs: 2 epochs of 3 batches.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import warm
from tests.helpers.checkpoints import list_checkpoints
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer import train
from trainer.errors import ConfigError, ConfigMismatchError, NotACheckpointError, TrainerError
from trainer.exports.exporter import export_serving, is_export, read_export_metadata, versions
from trainer.save_backends import load_checkpoint
from trainer.training import entry
from trainer.training.resume import resolve_resume, resume_hint

TINY = [
    "model=mlp",
    "data=synthetic",
    "save=weights",  # the quickest backend to write; the backends have tests of their own
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "trainer.steps_per_epoch=3",
    "trainer.verbose=0",
]
HANG_GUARD = 300  # seconds; only against a hung child, never asserted as a duration


def train_py(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None):
    """Run ``python train.py ARGS`` to the end; stdout and stderr together."""
    return warm.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd, env=env or subprocess_env(), capture_output=True, text=True, timeout=HANG_GUARD,
    )  # fmt: skip


def output_of(proc) -> str:
    return proc.stdout + proc.stderr


def printed_hint(output: str) -> list[str]:
    """The command after "resume with:" / "re-run with:", split as a shell would."""
    for line in output.splitlines():
        for marker in ("resume with: ", "re-run with: "):
            if marker in line:
                return shlex.split(line.split(marker, 1)[1])
    raise AssertionError(f"no resume command printed:\n{output[-3000:]}")


# ------------------------------------------------------- first epoch, hint, exactness
@pytest.fixture(scope="module")
def first_epoch_interrupt(tmp_path_factory):
    """A run that SIGTERMs itself after its first step; it stops after step 2 of 3 (the
    signal is seen at the next batch end), in the middle of the first epoch."""
    run = tmp_path_factory.mktemp("first-epoch") / "run"
    hook = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 1}"
    proc = train_py(*TINY, "export.enabled=false", hook, f"hydra.run.dir={run}")
    return run, proc


@pytest.mark.slow
def test_sigterm_in_the_first_epoch_exits_zero(first_epoch_interrupt):
    """Item 3: no StopIteration from an empty metrics dict; the interrupt checkpoint."""
    run, proc = first_epoch_interrupt
    output = output_of(proc)
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert "Interrupted in epoch 1, after 2 of its batches, step 2" in output
    state = load_checkpoint(run / "checkpoints" / "latest").state
    assert (state.epoch, state.step_in_epoch, state.history) == (0, 2, [])


@pytest.mark.slow
def test_the_printed_resume_command_works_as_printed(first_epoch_interrupt, tmp_path):
    """Item 5: the hint carries the run's own overrides (model=mlp data=synthetic ...); run
    verbatim (from another directory, so Hydra's session outputs land there) it finishes."""
    run, proc = first_epoch_interrupt
    command = printed_hint(output_of(proc))
    assert command[:2] == ["python", "train.py"]
    assert {"model=mlp", "data=synthetic", "resume=latest", f"resume_dir={run}"} <= set(command)
    resumed = train_py(*command[2:], cwd=tmp_path)
    assert resumed.returncode == 0, output_of(resumed)[-3000:]
    state = load_checkpoint(run / "checkpoints" / "latest").state
    assert (state.epoch, state.step_in_epoch, state.global_step) == (2, 0, 6)


@pytest.mark.slow
def test_nothing_to_resume_is_one_error_line_and_exit_2(tmp_path):
    """Items 14 and 2 through train.py: ``resume=latest`` with no checkpoint stays an
    error, printed as one ``error:`` line (no traceback, no Hydra report) with exit 2."""
    proc = train_py(*TINY, "resume=latest", f"resume_dir={tmp_path}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, output_of(proc)[-3000:]
    assert "Traceback" not in output_of(proc)
    assert "Error executing job" not in output_of(proc)
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: resume=latest found no complete checkpoint in {tmp_path}")
    assert error.endswith(f"Received directory {str(tmp_path)!r}")


@pytest.mark.slow
def test_a_group_override_hydra_cannot_apply_is_one_error_line_and_exit_2(tmp_path):
    """Hydra raises a plain ValueError for a group set to null ("Config group override must
    be a string or a list"): a traceback and exit 1 before; now an error line and exit 2.
    Both groups in one process (it was one process each): Hydra raises the same error from
    the same place for any group set to null, and the entry point handles it once."""
    proc = train_py("callbacks=null", "save=null", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, output_of(proc)[-3000:]
    assert "Traceback" not in output_of(proc)
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "Config group override must be a string or a list" in error


# ------------------------------------------------ resume=auto, export, finished runs
def has_hidden(directory: Path) -> bool:
    return directory.is_dir() and any(c.name.startswith(".") for c in directory.iterdir())


@pytest.mark.slow
def test_one_command_rerun_after_sigterm_in_the_export(tmp_path):
    """Items 2 and 3 (export): the same ``resume=auto`` command, twice.

    1. Fresh (nothing to resume: logged), SIGTERM once the export's temporary directory
       exists: exit 0, the interrupt noted, nothing half-written under a real name.
    2. Again: the run is complete, so "already trained 2 of 2 epochs", and the missing
       export is written.
    """
    run = tmp_path / "run"
    command = [
        sys.executable, str(ROOT / "train.py"), *TINY, "resume=auto", f"hydra.run.dir={run}",
        "checkpoint.policy.keep_last=1", "checkpoint.policy.keep_best=0",
    ]  # fmt: skip
    proc = warm.Popen(
        command, cwd=ROOT, env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + HANG_GUARD
    while not has_hidden(run / "export") and proc.poll() is None:
        assert time.monotonic() < deadline, "hung before the export"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    first, _ = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 0, first[-3000:]
    assert "resume=auto: no complete checkpoint" in first and "starting a fresh run" in first
    assert "Received SIGTERM" in first
    assert not has_hidden(run / "export"), sorted(p.name for p in (run / "export").iterdir())
    for version in versions(run / "export"):  # published before the signal landed: complete
        assert is_export(run / "export" / str(version))
    # Retention kept one checkpoint; the summary names only what is on disk.
    assert list_checkpoints(run / "checkpoints") == [run / "checkpoints" / "step-00000006"]
    assert "Checkpoints:   " + f"{run / 'checkpoints'}: step-00000006 (latest)" in first

    second = warm.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=HANG_GUARD)  # fmt: skip
    assert second.returncode == 0, output_of(second)[-3000:]
    assert "Already trained 2 of 2 epochs" in output_of(second)
    assert versions(run / "export") == [1]
    assert read_export_metadata(run / "export" / "1")["state"]["global_step"] == 6


# ----------------------------------------------------------------- in-process checks
def test_resume_latest_still_fails_clearly_where_auto_starts_fresh(tmp_path):
    """Item 2: ``auto`` -> None (fresh run), ``latest`` -> the clear error."""
    assert resolve_resume("auto", None, tmp_path) is None
    assert resolve_resume("auto", str(tmp_path / "nothing-yet"), tmp_path) is None
    with pytest.raises(NotACheckpointError, match="no complete checkpoint"):
        resolve_resume("latest", None, tmp_path)


@pytest.mark.slow
def test_mid_epoch_exactness_keys_refused_unless_allowed(compose_cfg, tmp_path, caplog):
    """Item 12: a mid-epoch checkpoint resumed with another batch size or steps per
    epoch is refused naming the keys; ``resume_allow_inexact=true`` continues, warned."""
    run = tmp_path / "run"
    base = ["model=mlp", "save=h5", "trainer.epochs=1", "checkpoint.policy.every_n_steps=2"]
    train(compose_cfg(*base))
    (mid_epoch,) = (run / "checkpoints").glob("step-00000002*")
    assert load_checkpoint(mid_epoch).state.step_in_epoch == 2
    changed = ["trainer.batch_size=8", "trainer.steps_per_epoch=4", f"resume={mid_epoch}"]
    with pytest.raises(ConfigMismatchError) as refused:
        train(compose_cfg(*base, *changed))
    message = str(refused.value)
    assert "trainer.batch_size is 16 in the checkpoint but 8 now" in message
    assert "trainer.steps_per_epoch is 3 in the checkpoint but 4 now" in message
    with pytest.raises(ConfigMismatchError, match=r"seed is 0 in the checkpoint but 1 now"):
        train(compose_cfg(*base, "seed=1", f"resume={mid_epoch}"))
    # At an epoch boundary the batch size may change (it only sets later epochs' batches).
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    (epoch_end,) = (copy / "checkpoints").glob("step-00000003*")
    train(compose_cfg(*base, "trainer.epochs=2", "trainer.batch_size=8", f"resume={epoch_end}"))
    assert load_checkpoint(copy / "checkpoints" / "latest").state.epoch == 2

    caplog.set_level("WARNING", logger="trainer.training.resume")
    train(compose_cfg(*base, *changed, "resume_allow_inexact=true"))
    assert "no longer matches an uninterrupted one" in caplog.text
    state = load_checkpoint(run / "checkpoints" / "latest").state
    assert (state.epoch, state.global_step) == (1, 4)  # 2 of the old 3 + 2 of the new 4


@pytest.mark.slow
def test_resuming_a_finished_run_writes_nothing_twice(compose_cfg, tmp_path, caplog):
    """Item 1: a complete run resumed (also with fewer epochs than it trained) logs
    "already trained", evaluates, and finds its hparams and export already written."""
    run = tmp_path / "run"
    base = ["model=mlp", "save=h5", "export.enabled=true", "export.format=keras"]
    first = train(compose_cfg(*base))
    caplog.set_level("INFO", logger="trainer")
    for epochs in (2, 1):
        again = train(compose_cfg(*base, f"trainer.epochs={epochs}", "resume=auto"))
        assert again == first
        assert f"Already trained 2 of {epochs} epochs" in caplog.text
        assert "HParams:       already written at step 6" in caplog.text
        assert f"{run / 'export' / '1'} (already written at step 6)" in caplog.text
        caplog.clear()
    assert versions(run / "export") == [1]
    assert load_checkpoint(run / "checkpoints" / "latest").state.global_step == 6


def test_resuming_from_a_serving_export_is_refused(tmp_path):
    """Item 16: an export is not a checkpoint of the run; the error names the run."""
    import keras

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    exported = export_serving(model, run / "export", format="keras")
    for resume, resume_dir in ((str(exported), None), ("auto", str(exported))):
        with pytest.raises(NotACheckpointError, match="is a serving export") as refused:
            resolve_resume(resume, resume_dir, tmp_path / "elsewhere")
        assert f"resume=latest resume_dir={run.resolve()}" in str(refused.value)


def test_an_unwritable_run_dir_is_a_config_error(compose_cfg, tmp_path):
    """Item 14: not a raw OSError (which train.py would print as a traceback)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot be written"):
        train(compose_cfg(f"run_dir={blocker / 'run'}"))


def test_deliberate_errors_are_one_line_and_exit_2(compose_cfg, monkeypatch, capsys):
    """Item 14 in-process: a TrainerError and Hydra's config errors (data=npz without a
    path) become ``error: <one line>`` with exit code 2; HYDRA_FULL_ERROR=1 re-raises."""
    with pytest.raises(Exception) as missing:
        train(compose_cfg("data=npz"))
    message = entry.deliberate_message(missing.value)
    assert message is not None and "data.path" in message and "\n" not in message

    def main():
        raise ConfigMismatchError("The config disagrees.\nResume with... Received: x")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited:
        entry.run(main)
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: The config disagrees. Resume with... Received: x\n"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(TrainerError):
        entry.run(main)
    assert entry.deliberate_message(RuntimeError("a bug")) is None


def test_resume_hint_quotes_overrides_and_drops_the_old_resume_keys(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    overrides = ["model=mlp", "resume=auto", "+callbacks.x={_target_: a.B}", "resume_dir=/old"]
    hint = resume_hint(checkpoint, "checkpoints", overrides)
    assert shlex.split(hint) == [
        "python", "train.py", "model=mlp", "+callbacks.x={_target_: a.B}",
        "resume=latest", f"resume_dir={tmp_path / 'run'}",
    ]  # fmt: skip


def test_a_signal_during_validation_stops_at_the_epochs_end_and_resumes_exactly(compose_cfg):
    """A SIGTERM that came while an epoch validated did not stop training: every later
    epoch trained on, each batch wrote a checkpoint, and the state counted more steps in
    the epoch than it has. It stops at that epoch's end now (its checkpoint holds the
    whole epoch), and the resumed run ends as an uninterrupted one."""
    from trainer import train
    from trainer.save_backends import load_checkpoint

    # The MLP, as the module's other tests: the check is where the loop stops and that the
    # resume is bitwise (Dropout's seed state included); the default ResNet tripled its cost.
    base = ("model=mlp", "save=h5", "trainer.epochs=3", "checkpoint.policy.keep_last=null")
    straight = compose_cfg(*base)
    train(straight)
    uninterrupted = Path(straight.run_dir).with_name("uninterrupted")
    shutil.move(straight.run_dir, uninterrupted)  # the same run directory is used again
    hook = "+callbacks.sigterm={_target_: faults.SignalInValidation, epoch: 0}"
    interrupted = compose_cfg(*base, hook)
    train(interrupted)
    latest = load_checkpoint(Path(interrupted.run_dir) / "checkpoints" / "latest")
    steps = latest.state.global_step
    assert latest.state.epoch == 1 and latest.state.step_in_epoch == 0 and steps > 0
    assert [h["epoch"] for h in latest.state.history] == [1]
    assert len(list((Path(interrupted.run_dir) / "checkpoints").glob("step-*"))) == 1
    train(compose_cfg(*base, "resume=auto"))
    done = load_checkpoint(Path(interrupted.run_dir) / "checkpoints" / "latest")
    want = load_checkpoint(uninterrupted / "checkpoints" / "latest")
    assert done.state.global_step == want.state.global_step == 3 * steps
    for a, b in zip(done.model.weights, want.model.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_resuming_an_older_checkpoint_sets_the_abandoned_branch_aside(compose_cfg, caplog):
    """After resuming from an older checkpoint, resume=latest picked the highest step, on
    the abandoned continuation, and jumped back to it; and this branch's saves replaced
    that one's checkpoints of the same names. They are moved aside, whole, instead."""
    from trainer import train
    from trainer.save_backends import load_checkpoint

    base = ("model=mlp", "save=h5", "checkpoint.policy.keep_last=null",
            "checkpoint.policy.every_n_steps=2")  # fmt: skip
    first = compose_cfg(*base, "trainer.epochs=3")
    train(first)
    checkpoints = Path(first.run_dir) / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.glob("step-*")}
    steps = {n: load_checkpoint(checkpoints / n).state.global_step for n in before}
    older = sorted(before)[1]  # a mid-run checkpoint
    older_step = steps[older]
    branch_start = time.time()
    train(compose_cfg(*base, "trainer.epochs=2", f"resume={checkpoints / older}"))
    (aside,) = checkpoints.glob("abandoned-*")
    later = sorted(n for n in before if steps[n] > older_step)
    assert later and sorted(p.name for p in aside.iterdir()) == later
    assert all((aside / n).read_bytes() == before[n] for n in later)  # moved, not rewritten
    branch_end = load_checkpoint(checkpoints / "latest").state
    assert branch_end.epoch == 2
    _abandoned_links_do_not_resolve(aside, checkpoints / older, branch_start)
    train(compose_cfg(*base, "trainer.epochs=2", "resume=latest"))
    assert load_checkpoint(checkpoints / "latest").state.global_step == branch_end.global_step
    # Moved with its run, a set-aside checkpoint still finds its run's log (its link was
    # written one folder up: it said "the event file is gone").
    from trainer.errors import TensorBoardLinkError
    from trainer.tensorboard.links import resolve_link

    moved = Path(first.run_dir).parent / "moved"
    shutil.move(first.run_dir, moved)
    for path in (moved / "checkpoints" / aside.name).iterdir():
        with pytest.raises(TensorBoardLinkError, match="abandoned"):
            resolve_link(path, load_checkpoint(path, compile=False).metadata)


def _abandoned_links_do_not_resolve(aside: Path, kept: Path, branch_start: float) -> None:
    """TensorBoard hides the abandoned branch's cards (the resumed session's restart
    purges them; a card of the same name that TensorBoard shows is the new branch's):
    their links are reported as not resolving, by ``resolve_link`` and by the run
    listing; the kept checkpoint's still resolves."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    from trainer.errors import TensorBoardLinkError
    from trainer.runs.index import describe_artifact
    from trainer.save_backends import load_checkpoint
    from trainer.tensorboard.links import resolve_link

    kept_meta = load_checkpoint(kept, compile=False).metadata
    log_dir = resolve_link(kept, kept_meta).log_dir
    shown = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})  # TensorBoard's
    shown.Reload()
    cards = shown.Tags()["tensors"]
    assert shown.Tensors(f"checkpoints/{kept.name}")
    for path in aside.iterdir():
        meta = load_checkpoint(path, compile=False).metadata
        tag = f"checkpoints/{path.name}"  # as TensorBoard shows it: hidden or replaced
        assert tag in cards and all(e.wall_time > branch_start for e in shown.Tensors(tag))
        with pytest.raises(TensorBoardLinkError, match="abandoned"):
            resolve_link(path, meta)
        listed = describe_artifact(path, "checkpoint", aside.parent.parent)
        assert listed["tensorboard"]["resolves"] is False
    listed = describe_artifact(kept, "checkpoint", kept.parent.parent)
    assert listed["tensorboard"]["resolves"] is True


def test_raising_epochs_under_pruning_with_a_derived_end_step_is_refused(compose_cfg):
    """wrap.end_step=null ends the pruning schedule at the run's last step: raising
    trainer.epochs on resume restarted it at another sparsity, and pruned weights came back
    (sparsity 0.50 -> 0.486 in the probe), silently. Refused, saying which end_step
    continues it; with that end_step the resume trains."""
    from trainer import train
    from trainer.errors import ConfigMismatchError

    # An MLP's Dense layers saved as h5: the check compares the run's configs, whatever the
    # model and backend (pruned ResNets and their SavedModels have tests in tests/wrapping/);
    # the default ResNet and SavedModel made this test ~4x as costly.
    prune = ("wrap=prune", "save=h5", "model=mlp")
    train(compose_cfg(*prune, "trainer.epochs=2"))
    raised = compose_cfg(*prune, "trainer.epochs=3", "resume=auto")
    with pytest.raises(ConfigMismatchError, match=r"set wrap\.end_step=6 to continue it"):
        train(raised)
    train(compose_cfg(*prune, "trainer.epochs=3", "resume=auto", "wrap.end_step=6"))


def test_a_fresh_run_over_an_earlier_runs_checkpoints_is_refused(compose_cfg):
    """A fresh run (no resume) given an earlier run's directory replaced its checkpoints of
    the same names, left the later ones, and a later resume=latest continued the earlier
    run. Refused before anything is written, naming resume=auto and a new directory."""
    base = ("model=mlp", "save=h5", "checkpoint.policy.keep_last=null")
    first = compose_cfg(*base, "trainer.epochs=2")
    train(first)
    checkpoints = Path(first.run_dir) / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.glob("step-*")}
    with pytest.raises(
        ConfigError, match=r"holds 2 checkpoint\(s\) of an earlier run.*resume=auto"
    ):
        train(compose_cfg(*base, "trainer.epochs=1"))
    assert {p.name: p.read_bytes() for p in checkpoints.glob("step-*")} == before
    train(compose_cfg(*base, "trainer.epochs=3", "resume=auto"))  # continuing it is fine
    assert len(before) == 2 and len(list(checkpoints.glob("step-*"))) == 3


def test_resuming_an_abandoned_checkpoint_continues_in_its_run(compose_cfg, tmp_path):
    """A checkpoint set aside in checkpoints/abandoned-<n>/ belongs to the run too: resuming
    it started a new run directory (the run-directory check missed the extra level)."""
    base = ("model=mlp", "save=h5", "checkpoint.policy.keep_last=null")
    train(compose_cfg(*base, "trainer.epochs=3"))
    checkpoints = tmp_path / "run" / "checkpoints"
    older = sorted(checkpoints.glob("step-*"))[0]
    train(compose_cfg(*base, "trainer.epochs=3", f"resume={older}"))
    (aside,) = checkpoints.glob("abandoned-*")
    abandoned = sorted(aside.glob("step-*"))[0]
    elsewhere = f"run_dir={tmp_path / 'elsewhere'}"
    train(compose_cfg(*base, "trainer.epochs=3", f"resume={abandoned}", elsewhere))
    assert not (tmp_path / "elsewhere" / "checkpoints").exists()
    assert len(list(checkpoints.glob("abandoned-*"))) == 2  # this branch set the other aside


def test_a_finished_branch_does_not_take_the_abandoned_branchs_export_or_finals(tmp_path):
    """A branch resumed from an older checkpoint reaches the step of the branch it
    abandoned. Its end of run (after a SIGTERM at the end, re-run) found that branch's
    export and final metrics "already written at step N" by step alone, and kept them:
    the run served the abandoned model and showed no finals of its own."""
    import keras
    import tensorflow as tf

    from trainer.state import TrainingState
    from trainer.training.progress import mark_session_start
    from trainer.training.run_end import FINAL_PREFIX, export_of_step, has_final_metrics

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    abandoned = TrainingState(epoch=2, global_step=6, history=[{"epoch": 1, "loss": 0.5}])
    mine = TrainingState(epoch=2, global_step=6, history=[{"epoch": 1, "loss": 0.4}])
    export_serving(model, tmp_path / "export", metadata={"state": abandoned.to_dict()})
    options = {"enabled": True}
    assert export_of_step(tmp_path, options, mine) is None
    assert export_of_step(tmp_path, options, abandoned) == tmp_path / "export" / "1"

    tb = tmp_path / "tb"
    for first, last, finals in ((1, 6, True), (4, 6, False)):  # resumed from step 3
        mark_session_start(tb, first - 1)
        writer = tf.summary.create_file_writer(str(tb))
        with writer.as_default():
            for step in range(first, last + 1):
                tf.summary.scalar("batch/loss", 1.0, step=step)
            if finals:
                tf.summary.scalar(f"{FINAL_PREFIX}val_loss", 0.2, step=last)
        writer.close()
        assert has_final_metrics(tb, 6) is finals
