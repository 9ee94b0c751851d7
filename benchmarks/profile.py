"""cProfile of one benchmarked operation, to find what dominates a missed target.

``python -m benchmarks.profile --size large --op repeat_save`` prints the top functions
by cumulative and by own time; ``--out x.prof`` keeps the raw stats (snakeviz, pstats).
Operations run once untimed on the tiny model first, so imports are not profiled.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks.specs import SIZES

OPS = ("first_save", "repeat_save", "load", "load_missing", "keras_save", "keras_load")


def prepare(size_name: str, op: str, root: Path):
    """Everything the operation needs, done untimed; returns the operation to profile."""
    import keras

    from benchmarks import models
    from trainer.save_backends import get_backend

    size = SIZES[size_name]
    backend = get_backend("savedmodel")
    model = models.build(size)
    if op == "first_save":
        return lambda: backend.save(model, root / "first")
    if op == "keras_save":
        return lambda: model.save(root / "x.keras")
    if op == "keras_load":
        model.save(root / "x.keras")
        return lambda: keras.models.load_model(root / "x.keras")
    backend.save(model, root / "first")
    models.train_step(model, size, seed=1)
    if op == "repeat_save":
        return lambda: backend.save(model, root / "repeat")
    if op == "load":
        return lambda: backend.load(root / "first")

    def load_missing():
        with models.block_class_missing(size):
            return backend.load(root / "first")

    return load_missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("--size", default="large", choices=sorted(SIZES))
    parser.add_argument("--op", default="repeat_save", choices=OPS)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="write raw pstats here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainer-profile-") as tmp:
        warm = prepare("tiny", args.op, Path(tmp) / "warm")
        warm()
        action = prepare(args.size, args.op, Path(tmp) / "measured")
        profiler = cProfile.Profile()
        profiler.enable()
        action()
        profiler.disable()
    stats = pstats.Stats(profiler)
    if args.out:
        stats.dump_stats(args.out)
    stats.strip_dirs()
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
