"""Loads only, ours against Keras's ``.keras``, paired: ``python -m benchmarks.load_pair``.

    python -m benchmarks.load_pair --sizes small,small_nobuild,large,large_nobuild --repeats 7

The full run (``benchmarks.run``) times every operation once per repeat, size after size;
on a busy machine minutes apart. This times one thing, the savedmodel load with every class
known against ``keras.models.load_model`` of a ``.keras`` file of the same model, in
alternating order repeat by repeat (ours first, then Keras first), so that background load
hits both alike. Prints each size's medians (min, max), the ratio of the medians and how
the custom blocks were revived; ``--json`` keeps every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks.specs import SIZES


def measure(name: str, repeats: int, root: Path) -> dict:
    import keras

    from benchmarks import cases, models

    size = SIZES[name]
    backend, why = cases.savedmodel_backend()
    if backend is None:
        raise SystemExit(why)
    model = models.build(size)
    ours_path = backend.save(model, root / f"{name}_ckpt")
    keras_path = root / f"{name}.keras"
    model.save(keras_path)
    loads = {
        "ours": lambda: backend.load(ours_path),
        "keras": lambda: keras.models.load_model(keras_path),
    }
    note = cases.revival_note(loads["ours"]())  # untimed: first-use costs of each
    loads["keras"]()
    times: dict[str, list[float]] = {"ours": [], "keras": []}
    for index in range(repeats):
        for key in ("ours", "keras") if index % 2 == 0 else ("keras", "ours"):
            gc.collect()
            start = time.perf_counter()
            loads[key]()
            times[key].append(time.perf_counter() - start)
    del model
    keras.backend.clear_session()
    gc.collect()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size": name,
        "description": size.description,
        "times": times,
        "medians": medians,
        "ratio": medians["ours"] / medians["keras"],
        "note": note,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,small_nobuild,large,large_nobuild")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="trainer-load-pair-") as workdir:
        for name in args.sizes.split(","):
            row = measure(name, args.repeats, Path(workdir))
            results.append(row)
            ours, theirs = row["times"]["ours"], row["times"]["keras"]
            print(
                f"{name} ({row['description']}): ours {row['medians']['ours']:.3f} s "
                f"({min(ours):.3f}-{max(ours):.3f}), .keras {row['medians']['keras']:.3f} s "
                f"({min(theirs):.3f}-{max(theirs):.3f}), ratio {row['ratio']:.2f}x; "
                f"{row['note']}; load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
