"""The floor TensorFlow sets under a first SavedModel save (issue 17's first-save target).

``python -m benchmarks.saver_floor --size deep --rounds 3`` times, side by side on fresh
models (modes alternated round by round): our first save, and ``tf.saved_model.save`` of a
bare ``tf.Module`` holding only the model's and optimizer's variables (no function at all)
with TensorFlow's SaverDef and without one. The bare save is what no SavedModel writer of
these variables can go below; the difference between its two modes is what TensorFlow's
traced SaverDef costs (trainer writes its own, ``savedmodel/saver_def.py``).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import tensorflow as tf

from benchmarks import models
from benchmarks.specs import SIZES

MODES = ("ours", "bare", "bare_skip_saver")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from trainer.save_backends import get_backend
    from trainer.save_backends.savedmodel.features.keras_objects import tf_variable

    backend = get_backend("savedmodel")
    root = Path(tempfile.mkdtemp(prefix="trainer-floor-"))
    try:
        warm = models.build(SIZES["tiny"], train=False)  # first-use costs, untimed
        backend.save(warm, root / "warm")
        bare = tf.Module()
        bare.variables_list = [tf_variable(v) for v in warm.variables]
        tf.saved_model.save(bare, str(root / "warm_bare"))
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for index in range(args.rounds):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                gc.collect()
                model = models.build(SIZES[args.size], seed=index, train=False)
                target = root / f"{mode}_{index}"
                start = time.perf_counter()
                if mode == "ours":
                    backend.save(model, target)
                else:
                    bare = tf.Module()
                    every = [*model.variables, *model.optimizer.variables]
                    bare.variables_list = [tf_variable(v) for v in every]
                    skip = mode == "bare_skip_saver"
                    options = tf.saved_model.SaveOptions(experimental_skip_saver=skip)
                    tf.saved_model.save(bare, str(target), options=options)
                times[mode].append(time.perf_counter() - start)
                shutil.rmtree(target)
        for mode, values in times.items():
            rounded = ", ".join(f"{v:.3f}" for v in values)
            print(f"{args.size} {mode}: median {statistics.median(values):.3f} s ({rounded})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
