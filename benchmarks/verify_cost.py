"""What issue 36's guarantees cost: checking every digest on load, and kept checkpoints that
share no file.

``python -m benchmarks.verify_cost --sizes small,large --repeats 7`` measures, for each size
and backend, ``load`` as it runs by default (every file's SHA-256 checked against the
manifest) and ``load(verify=False)`` (sizes only, the opt-out), alternating the two in one
process so that both see the same machine state. The ratio of the medians is the cost of
the check. The savedmodel and weights backends hash their value files in a thread while the
model is rebuilt (``integrity.DigestCheck``); h5 hashes its single file first, because HDF5
keeps no checksums of its own and its parser must not see damaged bytes.

For the savedmodel backend it also times what a repeat save now does with the graph file
the checkpoint before already holds: it writes ``saved_model.pb`` again (and the save's
fsync flushes it), where it used to hard-link it. Both are timed on the real file, written
and fsynced, side by side, next to the median repeat save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import models
from benchmarks.specs import SIZES
from trainer.save_backends import get_backend

BACKENDS = ("savedmodel", "h5", "weights")


def alternate(first: Callable[[], object], second: Callable[[], object], repeats: int):
    """Seconds of ``first`` and of ``second``, run in turn ``repeats`` times (one warm-up
    of each, not counted)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for side, call in zip(times, (first, second), strict=True):
            start = time.perf_counter()
            call()
            side.append(time.perf_counter() - start)
    return times


def load_rows(size_name: str, directory: Path, repeats: int) -> list[str]:
    size = SIZES[size_name]
    model = models.build(size)
    rows = []
    for name in BACKENDS:
        backend = get_backend(name)
        path = backend.save(model, directory / f"{size_name}-{name}")
        checked, unchecked = alternate(
            lambda b=backend, p=path: b.load(p),
            lambda b=backend, p=path: b.load(p, verify=False),
            repeats,
        )
        a, b = statistics.median(checked), statistics.median(unchecked)
        rows.append(
            f"| {size_name} | {name} | {a:.3f} s | {b:.3f} s | {a / b:.2f}x | {_mib(path)} |"
        )
    return rows


def link_rows(size_name: str, directory: Path, repeats: int) -> list[str]:
    """A repeat save's median, and the graph file written + fsynced against linked."""
    size = SIZES[size_name]
    model = models.build(size)
    backend = get_backend("savedmodel")
    first = backend.save(model, directory / f"{size_name}-first")
    saves = []
    for index in range(repeats):
        models.train_step(model, size, seed=index)
        start = time.perf_counter()
        backend.save(model, directory / f"{size_name}-repeat-{index}")
        saves.append(time.perf_counter() - start)
    graph = (first / "saved_model.pb").read_bytes()
    counter = iter(range(10**6))

    def write() -> None:
        target = directory / f"{size_name}-graph-{next(counter)}.pb"
        with open(target, "wb") as handle:
            handle.write(graph)
            handle.flush()
            os.fsync(handle.fileno())

    def link() -> None:
        os.link(first / "saved_model.pb", directory / f"{size_name}-graph-{next(counter)}.pb")

    written, linked = alternate(write, link, repeats)
    return [
        f"| {size_name} | {len(graph) / 1024:.0f} KiB | {statistics.median(saves):.3f} s | "
        f"{statistics.median(written) * 1000:.2f} ms | {statistics.median(linked) * 1000:.2f} ms |"
    ]


def _mib(path: Path) -> str:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return f"{sum(p.stat().st_size for p in files) / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large", help=f"of {sorted(SIZES)}")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="trainer-verify-cost-") as scratch:
        root = Path(scratch)
        print("| size | backend | load (digests checked) | load(verify=False) | ratio | size |")
        print("|---|---|---|---|---|---|")
        for size in sizes:
            for row in load_rows(size, root, args.repeats):
                print(row, flush=True)
        print()
        print("| size | saved_model.pb | repeat save (median) | graph written + fsync | linked |")
        print("|---|---|---|---|---|")
        for size in sizes:
            for row in link_rows(size, root, args.repeats):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
