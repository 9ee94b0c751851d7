"""What checkpointing every epoch costs the default training run, in steps per second.

Runs the real ``trainer.training.loop.train(cfg)`` on the default config, changing only the
checkpoint policy and backend through Hydra overrides, with one timing callback added
through ``callbacks``. Modes are interleaved repeat by repeat, each round starting with
another mode, so background load and order effects hit them alike. Besides wall-clock
steps/s it records the process CPU time per step (every thread, the async writer's
included): what a save adds to the work, which wall-clock time on a noisy 2-core machine
can hide or exaggerate.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from pathlib import Path

import keras

from benchmarks.timing import ERROR, NA, Result, not_available, remove

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
FULL = ("trainer.verbose=0",)  # the default run: resnet on digits, Adam, batch 64, 5 epochs
QUICK = (  # a smoke of the same path: every mode, tiny model, 2 epochs of 1 step
    "trainer.verbose=0",
    "model=mlp",
    "data=synthetic",
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "trainer.steps_per_epoch=1",
)
SAVEDMODEL = "save._target_=trainer.save_backends.savedmodel.SavedModelBackend"
NO_SAVES = (
    "checkpoint.policy.every_n_epochs=null",
    "checkpoint.policy.on_train_end=false",
    "checkpoint.policy.on_interrupt=false",
)
MODES = {
    "none": ("training, no checkpointing", NO_SAVES),
    "sync_savedmodel": (
        "training + sync savedmodel save every epoch",
        (SAVEDMODEL, "checkpoint.policy.async_save=false"),
    ),
    "sync_h5": (
        "training + sync h5 save every epoch (default save=h5)",
        ("checkpoint.policy.async_save=false",),
    ),
    "async_savedmodel": (
        "training + async savedmodel save every epoch",
        (SAVEDMODEL, "checkpoint.policy.async_save=true"),
    ),
}
HOOK = "+callbacks.epoch_clock={_target_:benchmarks.overhead.EpochClock}"


class EpochClock(keras.callbacks.Callback):
    """Timestamps of every epoch of the run's one ``fit``. An epoch ends when the next one
    begins (or training ends), so its time includes its checkpoint save, which a callback
    after this one takes in ``on_epoch_end``."""

    # (start, end, steps, process CPU seconds in the epoch); read after train()
    spans: list[tuple[float, float, int, float]] = []

    def on_train_begin(self, logs=None):
        self._start, self._steps = None, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._close()
        self._start, self._steps = time.perf_counter(), 0
        self._cpu = time.process_time()  # every thread: the async writer's work counts

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_train_end(self, logs=None):
        self._close()

    def _close(self):
        if self._start is not None:
            cpu = time.process_time() - self._cpu
            EpochClock.spans.append((self._start, time.perf_counter(), self._steps, cpu))
            self._start = None


def async_option() -> tuple[bool, str]:
    """Whether the checkpoint policy has async saving (the callback issue); until it has,
    the async rows say so instead of carrying a figure."""
    try:
        from trainer.checkpointing import CheckpointPolicy
    except ImportError as err:
        return False, f"no async checkpointing in this checkout ({err})"
    if "async_save" not in {f.name for f in dataclasses.fields(CheckpointPolicy)}:
        return False, "CheckpointPolicy has no async_save option"
    return True, ""


def compose(overrides: list[str]):
    from hydra import compose as _compose
    from hydra import initialize_config_dir

    import trainer.training.config  # noqa: F401  (the schemas conf/ extends)

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return _compose("config", overrides=overrides)


def run_once(
    base: tuple[str, ...], mode: str, run_dir: Path
) -> tuple[float, list[float], int, list[float], list[float]]:
    """One ``train(cfg)``; returns (run steps/s, steps/s of each epoch after the first,
    steps trained, the seconds each save after the first held the training loop, from the
    run's TensorBoard scalar ``checkpoint/blocking_seconds``, and the process CPU
    milliseconds per step of each epoch after the first).

    The run's time starts at the first epoch and ends when ``train`` returns (last write
    awaited, final evaluation included); model building and data loading are left out.
    """
    from trainer.training.loop import train

    cfg = compose([*base, *MODES[mode][1], HOOK, f"run_dir={run_dir}"])
    EpochClock.spans = []
    train(cfg)
    end = time.perf_counter()
    spans = EpochClock.spans
    if len(spans) != cfg.trainer.epochs:
        raise RuntimeError(f"expected {cfg.trainer.epochs} timed epochs, got {len(spans)}")
    total = sum(span[2] for span in spans)
    per_epoch = [steps / (stop - start) for start, stop, steps, _ in spans]
    cpu = [1000 * seconds / steps for _, _, steps, seconds in spans]
    blocking = blocking_seconds(run_dir)
    return total / (end - spans[0][0]), per_epoch[1:] or per_epoch, total, blocking[1:], cpu[1:]


def blocking_seconds(run_dir: Path) -> list[float]:
    """Every save's ``checkpoint/blocking_seconds`` in the run's TensorBoard log, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # "more than one graph event"
    by_step = {}
    for log_dir in {p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
        acc.Reload()
        if "checkpoint/blocking_seconds" in acc.Tags()["tensors"]:
            for event in acc.Tensors("checkpoint/blocking_seconds"):
                by_step[event.step] = float(tensor_util.make_ndarray(event.tensor_proto))
    return [by_step[step] for step in sorted(by_step)]


def _add_round_ratios(rows: dict[str, Result], medians: dict[str, float]) -> None:
    """One round's steady rate of each mode over the no-checkpoint run's of the same round:
    the runs of a round follow each other, so a drift of the machine's speed over the
    benchmark (10-15 % between runs here) moves both sides of each ratio alike."""
    for mode, row in rows.items():
        if "none" in medians and mode in medians:
            row.values.append(medians[mode] / medians["none"])
            row.note = f"{len(row.values)} rounds"


def measure(repeats: int, workdir: Path, *, quick: bool, log=print) -> list[Result]:
    base = QUICK if quick else FULL
    option, why_not = async_option()
    modes = [m for m in MODES if option or not m.startswith("async")]
    run_rows = {m: Result("training", f"train.{m}", MODES[m][0], unit="steps/s") for m in modes}
    steady_rows = {
        m: Result("training", f"train_steady.{m}", MODES[m][0], unit="steps/s") for m in modes
    }
    cpu_rows = {  # process CPU per step (all threads), every steady epoch pooled
        m: Result("training", f"train_cpu.{m}", MODES[m][0], unit="ms CPU per step") for m in modes
    }
    block_rows = {  # seconds a save after the first held the loop, median of each run
        m: Result("training", f"train_block.{m}", MODES[m][0], unit="s per save")
        for m in modes
        if m != "none"
    }
    round_rows = {  # each round's steady median over the no-checkpoint run's, same round
        m: Result("training", f"train_round.{m}", MODES[m][0], unit="x none, same round")
        for m in modes
        if m != "none"
    }
    for repeat in range(repeats):
        # Each round starts with another mode: the first run of a round follows the
        # previous round's last (and its leftovers in the process), so no mode always does.
        shift = repeat % len(modes)
        medians: dict[str, float] = {}
        for mode in modes[shift:] + modes[:shift]:
            if run_rows[mode].status == ERROR:
                continue
            run_dir = Path(workdir) / f"train_{mode}_{repeat}"
            try:
                run, steady, total, blocking, cpu = run_once(base, mode, run_dir)
            except Exception as err:  # reported in the table, never a number
                for rows in (run_rows, steady_rows, cpu_rows, block_rows, round_rows):
                    if mode not in rows:
                        continue
                    rows[mode].status = ERROR
                    rows[mode].note = f"{type(err).__name__}: {str(err)[:200]}"
                    rows[mode].values = []
                log(f"  [training] {mode}: error {type(err).__name__}: {err}")
                continue
            finally:
                remove(run_dir)
                keras.backend.clear_session()
                gc.collect()
            run_rows[mode].values.append(run)
            # Every steady epoch of every run, pooled: a 0.5 s epoch's rate varies by 10-30 %
            # on this machine, so one median per run could not resolve the 5 % target.
            steady_rows[mode].values.extend(steady)
            steady_rows[mode].note = f"{len(steady_rows[mode].values)} epochs, {repeat + 1} runs"
            cpu_rows[mode].values.extend(cpu)
            medians[mode] = statistics.median(steady)
            run_rows[mode].note = f"{total} steps per run"
            if mode in block_rows and blocking:
                block_rows[mode].values.append(statistics.median(blocking))
            elif mode in block_rows:
                block_rows[mode].status, block_rows[mode].note = "n/a", "one save per run"
            shown = f", blocking {statistics.median(blocking):.4f}s/save" if blocking else ""
            log(f"  [training] {mode}: {run:.1f} steps/s (steady {medians[mode]:.1f}){shown}")
        _add_round_ratios(round_rows, medians)
    for row in round_rows.values():
        if not row.values and row.status != ERROR:
            row.status, row.note = NA, "no round measured both this mode and none"
    results = [*run_rows.values(), *steady_rows.values(), *cpu_rows.values()]
    results += [*block_rows.values(), *round_rows.values()]
    if not option:
        label = MODES["async_savedmodel"][0]
        for prefix in ("train", "train_steady", "train_cpu", "train_block", "train_round"):
            results.append(not_available("training", f"{prefix}.async_savedmodel", label, why_not))
    return results
