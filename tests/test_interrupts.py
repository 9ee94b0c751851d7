"""SIGTERM and SIGINT, phase by phase (issue 37: one stack of handlers).

In-process: each phase of ``trainer.training.interrupts`` answers while it is the innermost
one and the previous handlers are back after it, for the stack itself and for each of the
four phases built on it.
"""

from __future__ import annotations

import signal
import threading

import pytest

from trainer.state import TrainingState
from trainer.training import interrupts, run_end, sweeps
from trainer.training.distribute import AgreeOnStop, Distribution
from trainer.training.progress import RunProgress

SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
    """The phase entered after it answers, and restores what was there before both."""
    seen = []
    first = interrupts.Phase("first", lambda *_: seen.append("first")).__enter__()
    with interrupts.Phase("second", lambda *_: seen.append("second")):
        first.remove()
        signal.raise_signal(signal.SIGTERM)
    assert seen == ["second"]


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
