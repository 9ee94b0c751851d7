"""SIGTERM and SIGINT, phase by phase (issue 37: one stack of handlers; issue 39 item 4: a
signal during start-up).

In-process: each phase of ``trainer.training.interrupts`` answers while it is the innermost
one and the previous handlers are back after it, for the stack itself and for each of the
four phases built on it. In a real ``python train.py``: a SIGTERM or Ctrl-C while
TensorFlow is being imported exits 0 with one line (it was killed, silently).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import warm
from tests.helpers.checkpoints import list_checkpoints
from tests.helpers.config import TINY
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer import train
from trainer.save_backends import load_checkpoint
from trainer.state import TrainingState
from trainer.training import distribute, interrupts, run_end, sweeps
from trainer.training.distribute import AgreeOnStop, Distribution
from trainer.training.progress import RunProgress

SIGNALS = (signal.SIGTERM, signal.SIGINT)
HANG_GUARD = 300  # seconds; only against a hung child, never asserted as a duration


def handlers() -> dict[int, object]:
    return {sig: signal.getsignal(sig) for sig in SIGNALS}


@pytest.fixture(autouse=True)
def no_stale_records():
    interrupts.take()
    before = handlers()
    yield
    assert handlers() == before, "a phase left its handlers installed"
    assert interrupts.current() is None
    interrupts.take()


def test_the_innermost_phase_answers_and_the_enclosing_one_again_after_it():
    seen = []
    with interrupts.Phase("outer", lambda signum, _: seen.append(("outer", signum))):
        with interrupts.Phase("inner", lambda signum, _: seen.append(("inner", signum))):
            assert interrupts.current() == "inner"
            signal.raise_signal(signal.SIGTERM)
        assert interrupts.current() == "outer"
        signal.raise_signal(signal.SIGINT)
    assert seen == [("inner", signal.SIGTERM), ("outer", signal.SIGINT)]


def test_leaving_a_phase_ends_the_phases_still_entered_inside_it():
    outer = interrupts.Phase("outer", lambda *_: None).__enter__()
    interrupts.Phase("left open", lambda *_: None).__enter__()
    outer.leave()
    assert interrupts.current() is None


def test_a_phase_removed_from_under_another_hands_its_restore_to_it():
    """How start-up ends: the sweep's phase answers, and restores what was there before
    start-up."""
    seen = []
    first = interrupts.Phase("start-up", lambda *_: seen.append("start-up")).__enter__()
    with interrupts.Phase("sweep", lambda *_: seen.append("sweep")):
        first.remove()
        signal.raise_signal(signal.SIGTERM)
    assert seen == ["sweep"]


def test_outside_the_main_thread_a_phase_installs_nothing():
    outcome = []

    def enter():
        with interrupts.Phase("worker thread", lambda *_: None) as phase:
            outcome.append((phase.active, interrupts.current()))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert outcome == [(False, None)]


def test_training_loop_stops_after_the_batch_and_a_second_ctrl_c_interrupts_at_once():
    progress = RunProgress(TrainingState(), steps_per_epoch=3)
    with pytest.raises(KeyboardInterrupt), progress.stop_on_signals():
        signal.raise_signal(signal.SIGINT)
        assert progress.requested_signal == signal.SIGINT
        assert interrupts.take() == "SIGINT"
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM only asks again
        signal.raise_signal(signal.SIGINT)


def test_run_set_up_and_end_raise_once_and_ignore_signals_while_unwinding():
    with pytest.raises(run_end.RunInterrupted) as raised, run_end.signals_raise():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            signal.raise_signal(signal.SIGINT)  # cleanup is not interrupted
            signal.raise_signal(signal.SIGTERM)
    assert raised.value.signal_name == "SIGTERM"
    assert interrupts.take() == "SIGTERM"


def test_the_sweep_remembers_a_signal_outside_any_session():
    with sweeps.watch():
        signal.raise_signal(signal.SIGTERM)
        assert sweeps._state.pending == "SIGTERM"
        assert sweeps.skip_job()  # not a multirun: nothing is run


def test_multi_worker_training_marks_the_worker_inside_the_loops_phase():
    progress = RunProgress(TrainingState(), steps_per_epoch=3)
    dist = Distribution(kind="multiworker")
    (agreement,) = dist.callbacks(progress)
    assert isinstance(agreement, AgreeOnStop)
    with pytest.raises(KeyboardInterrupt), progress.stop_on_signals(), dist.stop_agreement():
        signal.raise_signal(signal.SIGTERM)
        # Marked only: every worker stops once the next batch's all-reduce agrees.
        assert agreement.received == signal.SIGTERM and progress.requested_signal is None
        signal.raise_signal(signal.SIGINT)  # a second Ctrl-C: at once
    assert Distribution().stop_agreement().__enter__() is None  # one device: no phase


# ------------------------------------------------------------ issue 39 item 4: start-up
def test_a_signal_while_the_strategy_is_built_ends_the_session_before_training(
    compose_cfg, monkeypatch, caplog
):
    """Building a multi-worker strategy can wait for its peers; a signal then only reached
    the sweep's phase (remembered, and the run trained to its end anyway)."""

    def setup_receiving_a_signal(_cfg):
        signal.raise_signal(signal.SIGTERM)
        return Distribution()

    def outside(signum, _frame):
        raise AssertionError("the signal reached the phase around train()")

    monkeypatch.setattr(distribute, "setup", setup_receiving_a_signal)
    with interrupts.Phase("around train()", outside):
        assert train(compose_cfg()) == {}
    assert "Received SIGTERM before training started" in caplog.text
    assert interrupts.take() == "SIGTERM"


def _importing_tensorflow(pid: int) -> bool:
    """Whether TensorFlow's shared library is mapped into ``pid``: its import has begun,
    seconds before the run is set up."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "libtensorflow_framework" in maps or "_pywrap_tensorflow_internal" in maps


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/<pid>/maps")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_tensorflow_is_imported_exits_zero_with_one_line(tmp_path, signum):
    """It was killed by the signal (exit code -15) or ended in a KeyboardInterrupt
    traceback, saying nothing, although SIGTERM or Ctrl-C at any point exits 0."""
    run = tmp_path / "run"
    # A real process, never a warm one (tests.helpers.warm): this is about the imports.
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "model=mlp", *TINY, f"hydra.run.dir={run}"],
        cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + HANG_GUARD
    while not _importing_tensorflow(proc.pid):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "TensorFlow's import never began"
        time.sleep(0.002)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 0, (proc.returncode, err[-3000:])
    name = signal.Signals(signum).name
    assert err.splitlines() == [interrupts.STARTUP_MESSAGE.format(name=name)], err[-3000:]
    assert out == ""
    assert not run.exists()  # nothing was written


# ------------------------------------------------------- issue 39 item 3: a broken pipe
@pytest.mark.slow
def test_a_console_pipe_whose_reader_is_gone_costs_no_interrupt_checkpoint(tmp_path):
    """``python train.py 2>&1 | tee log`` and Ctrl-C to the process group: ``tee`` ends
    first, and the trainer's next console write raised ``BrokenPipeError``; it exited 1
    without a word and without its interrupt checkpoint. Now the console goes to
    /dev/null, and the run stops as asked, its log still written."""
    run = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith(("trainer.epochs=", "trainer.verbose="))]
    proc = warm.Popen(
        [
            sys.executable, str(ROOT / "train.py"), "model=mlp", "save=weights", *tiny,
            "trainer.epochs=200", "trainer.verbose=1", f"hydra.run.dir={run}",
        ],
        cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + HANG_GUARD
    while not (run / "checkpoints").is_dir() or not list_checkpoints(run / "checkpoints"):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "hung: no checkpoint was written"
        time.sleep(0.05)
    proc.stdout.close()  # the reader of the console's pipe is gone
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=HANG_GUARD)
    log = (run / "train.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "Received SIGINT: stopping after this batch" in log
    assert "its output now goes to /dev/null" in log
    (interrupted,) = [line for line in log.splitlines() if "] - Interrupted " in line]
    step = int(re.search(r", step (\d+)\.", interrupted).group(1))
    assert load_checkpoint(run / "checkpoints" / "latest").state.global_step == step
    assert 0 < step < 600
