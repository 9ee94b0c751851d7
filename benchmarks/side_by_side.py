"""Two checkouts of trainer side by side on the default training run (``benchmarks.overhead``'s
modes): steady-state steps/s and the seconds each save held the training loop.

    python -m benchmarks.side_by_side --old /work/main/src --new src --repeats 3

Every run is a fresh process (imports and TensorFlow's caches alike for both), and runs
are interleaved repeat by repeat, mode by mode, old then new, so that background load hits
both alike. Prints one JSON line per run and a summary (median, min, max per checkout and
mode); ``--out`` keeps every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "sync_savedmodel", "async_savedmodel")


def child(mode: str, quick: bool = False) -> None:
    """One default training run in this process (``quick``: the smoke-sized one); prints
    its figures as ``RESULT {...}``."""
    from benchmarks import overhead

    with tempfile.TemporaryDirectory() as workdir:
        run_dir = Path(workdir) / "run"
        base = overhead.QUICK if quick else overhead.FULL
        run, steady, total, _, _ = overhead.run_once(base, mode, run_dir)
        epochs = [steps / (end - start) for start, end, steps, _ in overhead.EpochClock.spans]
        blocking = overhead.blocking_seconds(run_dir) if mode != "none" else []
    figures = {"run": run, "steady": statistics.median(steady), "steps": total, "epochs": epochs}
    print("RESULT " + json.dumps({**figures, "blocking": blocking}), flush=True)


def run(src: str, mode: str, quick: bool = False) -> dict | None:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{ROOT}", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.side_by_side", "--child", mode]
        + (["--quick"] if quick else []),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        print(f"{src} {mode}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def summary(results: list[dict]) -> None:
    def spread(values):
        if not values:
            return "-"
        return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"

    for mode in MODES:
        for code in ("old", "new"):
            rows = [r for r in results if r["mode"] == mode and r["code"] == code]
            later = [statistics.median(r["blocking"][1:]) for r in rows if r["blocking"][1:]]
            print(
                f"{mode:17s} {code}: steady {spread([r['steady'] for r in rows])} steps/s, "
                f"run {spread([r['run'] for r in rows])} steps/s, "
                f"1st save blocks {spread([r['blocking'][0] for r in rows if r['blocking']])} s, "
                f"later saves {spread(later)} s (median per run), n={len(rows)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="src directory of the old checkout")
    parser.add_argument("--new", help="src directory of the new checkout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run per mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.quick)
        return
    results = []
    for repeat in range(args.repeats):
        for mode in MODES:
            for code, src in (("old", args.old), ("new", args.new)):
                load = os.getloadavg()[0]
                figures = run(str(Path(src).resolve()), mode, args.quick)
                if figures is None:
                    continue
                results.append({**figures, "code": code, "mode": mode, "repeat": repeat})
                results[-1]["load_before"] = load
                shown = {k: v for k, v in results[-1].items() if k != "epochs"}
                print(json.dumps(shown), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))
    summary(results)


if __name__ == "__main__":
    main()
