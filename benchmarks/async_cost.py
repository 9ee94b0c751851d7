"""What an async save costs the epoch it overlaps, and why: paired epochs in one run.

``python -m benchmarks.async_cost --epochs 161 --runs 2`` trains the default config with
an async savedmodel save every ``--every`` (4) epochs and compares, inside one process,
the two epochs a save touches (the one it is taken at, which the snapshot holds, and the
next, which the write overlaps) with the two clean epochs after them. Runs on the same
machine differ by 10-15 % in speed, epochs of one run far less, so each pair is compared
with its neighbours only. Reported: the median and mean extra time of a save's pair over
its clean pair, as a share of one epoch (the cost of one save per epoch).

``--writer`` swaps what the background thread does, to tell the write's own cost from
anything else: ``real`` (trainer's write), ``sleep`` (waits as long as a write takes but
uses no CPU: what the snapshot and the thread hand-off cost), ``burn`` (spends
``--burn-ms`` of CPU in Python, holding the GIL), ``hash`` (the same CPU in SHA-256
over a buffer, which releases the GIL) and ``files`` (the floor of any durable checkpoint
of these bytes: the first save is trainer's; every later one writes that checkpoint's
files again from memory into a temporary sibling with plain ``os`` calls, hard-links the
graph file as trainer does, flushes the filesystem once (``syncfs``, as trainer's writer
thread does), renames it into place and deletes the checkpoint ``keep_last`` saves old;
no serialization, no metadata, no TensorFlow). The stand-ins patch
``CheckpointManager._write`` in this process only; they are an experiment, never a mode
of trainer.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import keras

from benchmarks.overhead import FULL, QUICK, SAVEDMODEL, compose

WRITERS = ("real", "sleep", "burn", "hash", "files")


class EpochStarts(keras.callbacks.Callback):
    times: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        EpochStarts.times.append(time.perf_counter())

    def on_train_end(self, logs=None):
        EpochStarts.times.append(time.perf_counter())


def stand_in(kind: str, burn_ms: float):
    """A replacement for ``CheckpointManager._write`` that does no saving at all."""
    buffer = os.urandom(4 << 20)
    seconds = burn_ms / 1000

    def write(self, *args, **kwargs):
        if kind == "sleep":
            time.sleep(seconds)
        elif kind == "burn":
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
        elif kind == "hash":
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                hashlib.sha256(buffer).digest()

    return write


def files_floor(real_write):
    """The ``files`` stand-in: trainer's first write, then the same files by hand."""
    from trainer.storage.atomic import flushing_whole_filesystem, fsync_tree

    def write(self, job, *args, **kwargs):
        path = job.path  # ``writing.CheckpointWrite``
        # Per manager (one per run): the template, and the checkpoints written since.
        floor = self.__dict__.setdefault("_files_floor", ({}, []))
        template: dict[str, bytes] = floor[0]
        written: list[Path] = floor[1]
        if not written:
            real_write(self, job, *args, **kwargs)
            for file in sorted(Path(path).rglob("*")):
                if file.is_file():
                    template[str(file.relative_to(path))] = file.read_bytes()
            written.append(Path(path))
            return
        tmp = path.with_name(f".{path.name}.floor")
        for relative, data in template.items():
            target = tmp / relative
            os.makedirs(target.parent, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        with flushing_whole_filesystem():
            fsync_tree(tmp)
        os.rename(tmp, path)
        written.append(path)
        if len(written) > self.policy.keep_last:
            old = written.pop(0)
            trash = old.with_name(f".{old.name}.trash")
            os.rename(old, trash)
            shutil.rmtree(trash)

    return write


def pair_costs(durations: list[float], every: int) -> list[float]:
    """For each save after the first two: (its two epochs - the next two) / one clean
    epoch. Epoch ``k * every - 1`` (0-based) ends with a save."""
    costs = []
    for k in range(3, len(durations) // every + 1):
        at = k * every - 1
        if at + 3 >= len(durations) - 1:  # the last epoch also holds the final write
            break
        hit = durations[at] + durations[at + 1]
        clean = durations[at + 2] + durations[at + 3]
        costs.append((hit - clean) / (clean / 2))
    return costs


def run_once(epochs: int, every: int, workdir: Path, quick: bool = False) -> list[float]:
    from trainer.training.loop import train

    cfg = compose(
        [
            *(o for o in (QUICK if quick else FULL) if not o.startswith("trainer.epochs=")),
            SAVEDMODEL,
            "checkpoint.policy.async_save=true",
            f"checkpoint.policy.every_n_epochs={every}",
            f"trainer.epochs={epochs}",
            "export.enabled=false",
            "+callbacks.epoch_starts={_target_:benchmarks.async_cost.EpochStarts}",
            f"run_dir={workdir}",
        ]
    )
    # Hydra builds the callback from this module's import name, which differs from
    # ``__main__`` when run with ``python -m``: read the class it built.
    from benchmarks.async_cost import EpochStarts as built

    built.times = []
    train(cfg)
    times = built.times
    return [b - a for a, b in itertools.pairwise(times)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=161)
    parser.add_argument("--every", type=int, default=4, help="epochs per save, at least 4")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--writer", choices=WRITERS, default="real")
    parser.add_argument("--burn-ms", type=float, default=8.0, help="CPU (or sleep) per save")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model")
    args = parser.parse_args(argv)
    if args.every < 4:  # the clean pair after a save's pair must hold no save
        parser.error(f"--every must be at least 4. Received: {args.every}")
    if args.epochs < 6 * args.every:  # two saves after the first two, each with a clean pair
        parser.error(f"--epochs must be at least 6 x --every. Received: {args.epochs}")
    if args.writer != "real":
        from trainer.checkpointing import manager

        real_write = manager.CheckpointManager._write
        manager.CheckpointManager._write = (
            files_floor(real_write)
            if args.writer == "files"
            else stand_in(args.writer, args.burn_ms)
        )
    costs: list[float] = []
    epoch_seconds: list[float] = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="trainer-asynccost-") as workdir:
            run_dir = Path(workdir) / f"run{index}"
            durations = run_once(args.epochs, args.every, run_dir, quick=args.quick)
        costs += pair_costs(durations, args.every)
        epoch_seconds += durations[1:-1]
        keras.backend.clear_session()
    shown = "" if args.writer in ("real", "files") else f" ({args.burn_ms:g} ms)"
    spread = (
        f", standard error {100 * statistics.stdev(costs) / len(costs) ** 0.5:.1f}"
        if len(costs) > 1
        else ""
    )
    print(
        f"writer={args.writer}{shown}: {len(costs)} saves, median epoch "
        f"{1000 * statistics.median(epoch_seconds):.1f} ms; one save costs the epochs it "
        f"touches {100 * statistics.median(costs):+.1f} % of an epoch (median), "
        f"{100 * statistics.mean(costs):+.1f} % (mean{spread})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
