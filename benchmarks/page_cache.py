"""What writing a checkpoint's bytes costs when the kernel has no freed pages to reuse.

``python -m benchmarks.page_cache --mib 97 --rounds 6`` writes the same bytes, round after
round, with one eager ``SaveV2`` (what trainer's repeat save and TensorFlow's checkpoint
writer both end in) and with a plain Python ``write``, each two ways: into pages the
system must newly allocate ("fresh": no file was deleted before, as for a first save in
a process that never deleted one), and into pages just freed by deleting a file of the
same size ("reused": as a repeat save after retention deleted the oldest checkpoint).
No fsync: the copy into the page cache alone (for ``O_DIRECT``, trainer's
``direct_io.StreamedFile`` as its bundle writer uses it, the write to the device, hashed).
On a virtual machine the fresh case can include the hypervisor backing guest memory touched
for the first time. Issue 17's first-save figures include this cost, for tf_keras and, before
trainer wrote large bundles itself, for trainer.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from trainer.storage import direct_io


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=97, help="bytes written per round, MiB")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    count = max(1, args.mib)  # 1 MiB float32 tensors
    variables = [tf.Variable(tf.random.normal([512, 512])) for _ in range(count)]
    names = tf.constant([f"v{i}" for i in range(count)])
    slices = tf.constant([""] * count)
    blob = np.random.default_rng(0).bytes(count << 20)

    def save_v2(prefix: Path) -> None:
        values = [tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype) for v in variables]
        tf.raw_ops.SaveV2(
            prefix=str(prefix), tensor_names=names, shape_and_slices=slices, tensors=values
        )

    def python_write(prefix: Path) -> None:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.write_bytes(blob)

    def direct_write(prefix: Path) -> None:  # what trainer's own bundle writer uses
        prefix.parent.mkdir(parents=True, exist_ok=True)
        streamed = direct_io.StreamedFile(prefix)
        streamed.write(blob)
        streamed.close()

    root = Path(tempfile.mkdtemp(prefix="trainer-pagecache-"))
    times: dict[str, list[float]] = {}
    try:
        for index in range(args.rounds):
            writers = (
                (save_v2, "SaveV2"),
                (python_write, "python write"),
                (direct_write, "O_DIRECT StreamedFile" if direct_io.direct_wanted() else "no"),
            )
            for writer, label in writers:
                for mode in ("fresh", "reused"):
                    if mode == "reused":  # free as many pages just before the write
                        scratch = root / f"scratch_{index}" / "data"
                        writer(scratch)
                        shutil.rmtree(scratch.parent)
                    target = root / f"{label.replace(' ', '_')}_{mode}_{index}" / "data"
                    start = time.perf_counter()
                    writer(target)
                    times.setdefault(f"{label}, {mode} pages", []).append(
                        time.perf_counter() - start
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{count} MiB per write, {args.rounds} rounds (seconds: median [min, max])")
    for label, values in times.items():
        print(
            f"  {label:36s} {statistics.median(values):.3f} "
            f"[{min(values):.3f}, {max(values):.3f}]  all: {[round(v, 3) for v in values]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
