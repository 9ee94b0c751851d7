"""The CPU one async savedmodel save costs its writer thread, split into user and kernel time.

``python -m benchmarks.writer_cpu --saves 150`` builds the default config's model (the
residual network of ``conf/model/resnet.yaml`` on 8x8 digits), makes it what the async
writer saves (a private copy, ``modelstate``, with the repeat-save variables write traced,
as the async rehearsal does) and saves it through a ``CheckpointManager`` with a
TensorBoard board, synchronously, in this thread: the same work the writer thread does per
save (checkpoint, ``latest``, retention, the card), inside
``atomic.flushing_whole_filesystem`` as the writer thread is. The state carries a 40-epoch
history and NumPy's RNG, as a run's does. Reported: the median CPU per save after the
first five (``time.thread_time``), and the mean user and system time (``RUSAGE_THREAD``,
Linux).

Why it exists: the async steady-state cost grows with the writer's CPU (``async_cost``), and
inside training that CPU reads 1.1-1.7x what it reads here, moved by what the training
threads do. Quiet, one process reads within a few percent; separate processes differ by
up to 1.5x on this VM, so compare two versions of the code only inside one process, or
over several alternating runs.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np

HISTORY = [
    {"epoch": i, "loss": 0.1, "accuracy": 0.9, "val_loss": 0.2, "val_accuracy": 0.9}
    for i in range(40)
]


def measure(saves: int) -> dict[str, float]:
    from trainer.checkpointing import CheckpointManager, CheckpointPolicy, numpy_rng_record
    from trainer.model_state import kit
    from trainer.models import build_resnet
    from trainer.state import TrainingState
    from trainer.storage import atomic
    from trainer.tensorboard.board import RunBoard

    keras.utils.set_random_seed(0)
    model = build_resnet((8, 8, 1), 10, blocks=2, width=16)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 8, 8, 1), "float32"), rng.integers(0, 10, 256)
    model.fit(x, y, epochs=1, verbose=0)
    kit.mark_private_copy(model)
    root = Path(tempfile.mkdtemp(prefix="writer-cpu-"))
    try:
        policy = CheckpointPolicy(async_save=False, keep_last=3)
        board = RunBoard(root / "tb")
        manager = CheckpointManager(root / "checkpoints", "savedmodel", policy, board=board)
        manager.save(model, TrainingState())  # the first, full save
        manager.backend.prepare_repeat_saves(model, root / "scratch")
        cpu, user, system = [], [], []
        # (getattr: the same command measures versions of trainer from before that switch)
        with getattr(atomic, "flushing_whole_filesystem", contextlib.nullcontext)():
            for step in range(1, saves + 1):
                state = TrainingState(
                    epoch=step,
                    global_step=step,
                    history=HISTORY,
                    metrics=HISTORY[-1],
                    numpy_rng=numpy_rng_record(),
                )
                model.optimizer.iterations.assign(step)
                before = resource.getrusage(resource.RUSAGE_THREAD)
                started = time.thread_time()
                manager.save(model, state)
                cpu.append(time.thread_time() - started)
                after = resource.getrusage(resource.RUSAGE_THREAD)
                user.append(after.ru_utime - before.ru_utime)
                system.append(after.ru_stime - before.ru_stime)
        board.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    skip = min(5, saves - 1)
    return {
        "cpu_ms": 1000 * statistics.median(cpu[skip:]),
        "user_ms": 1000 * statistics.mean(user[skip:]),
        "system_ms": 1000 * statistics.mean(system[skip:]),
        "saves": len(cpu) - skip,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=150)
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("writer_cpu needs RUSAGE_THREAD (Linux)")
        return 2
    result = measure(max(args.saves, 2))
    print(
        f"writer CPU per repeat savedmodel save: {result['cpu_ms']:.2f} ms (median of "
        f"{result['saves']}), user {result['user_ms']:.2f} ms + system "
        f"{result['system_ms']:.2f} ms (means)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
