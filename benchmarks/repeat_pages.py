"""Repeat saves of one model into freshly allocated pages against pages just freed.

``python -m benchmarks.repeat_pages --size large --saves 6`` trains a step and saves the
model through the savedmodel backend, alternating two ways: every checkpoint kept (each
save writes into pages the kernel must newly allocate) and the previous checkpoint deleted
first (the save writes into pages just freed, as in training, where retention deletes the
oldest checkpoint after each save). ``benchmarks.run`` times repeat saves the second way;
this shows what the first costs on the same machine (``page_cache`` shows the same effect
on a bare TensorFlow write and a Python one).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import models, specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(specs.SIZES), default="large")
    parser.add_argument("--saves", type=int, default=6, help="saves of each kind")
    args = parser.parse_args(argv)
    from trainer.save_backends import get_backend

    size = specs.SIZES[args.size]
    model = models.build(size, seed=0)
    backend = get_backend("savedmodel")
    root = Path(tempfile.mkdtemp(prefix="trainer-repeatpages-"))
    times: dict[str, list[float]] = {"kept": [], "after a deletion": []}
    try:
        backend.save(model, root / "first")  # traces; the repeat saves reuse them
        models.train_step(model, size, seed=1)
        backend.save(model, root / "second")  # a model's first repeat save: one-time costs
        shutil.rmtree(root / "first")
        previous = root / "second"
        for index in range(args.saves):
            for mode, seconds in times.items():
                models.train_step(model, size, seed=10 + index)
                if mode != "kept":
                    shutil.rmtree(previous)
                gc.collect()
                target = root / f"{mode.replace(' ', '_')}_{index}"
                start = time.perf_counter()
                backend.save(model, target)
                seconds.append(time.perf_counter() - start)
                if mode != "kept":
                    previous = target
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mode, seconds in times.items():
        shown = ", ".join(f"{s:.3f}" for s in seconds)
        print(
            f"{args.size} repeat save, {mode}: median {statistics.median(seconds):.3f} s ({shown})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
