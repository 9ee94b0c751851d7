"""One command for every figure: ``python -m benchmarks.run [--quick]``.

Measures, per model size, our save backends, Keras 3's formats and the disk floor in this
process; the tf_keras anchor in a child process (tf_keras and Keras 3 interfere in one
process); then the checkpoint overhead on a default training run. Writes the markdown
report (``benchmarks/README.md`` by default) and the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks import machine, report
from benchmarks.specs import DEFAULT_SIZES, QUICK_SIZES, SIZES
from benchmarks.timing import ERROR, NA, Result, not_available

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ANCHOR_TIMEOUT = 15 * 60


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Save/load/training-overhead benchmarks against Keras 3, tf_keras and "
        "the disk's write-and-fsync floor.",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per figure")
    parser.add_argument(
        "--repeats-for",
        default="",
        help="per-size overrides, e.g. large=2,applications=2 (said so in the report)",
    )
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"of {sorted(SIZES)}")
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 1 repeat, short training: < 60 s"
    )
    parser.add_argument("--training-repeats", type=int, default=None)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-anchor", action="store_true", help="no tf_keras subprocess")
    parser.add_argument("--workdir", default=None, help="scratch directory (the measured disk)")
    parser.add_argument("--output", default=None, help="markdown report path")
    parser.add_argument("--json", default=None, help="raw results path")
    parser.add_argument("--note", action="append", default=[], help="extra line for the report")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.sizes = ",".join(QUICK_SIZES)
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; valid: {sorted(SIZES)}")
    if args.output is None and not args.quick:
        args.output = str(HERE / "README.md")
    if args.json is None and not args.quick:
        args.json = str(HERE / "results.json")
    return args


def repeats_for(args: argparse.Namespace) -> dict[str, int]:
    overrides = dict(item.split("=") for item in args.repeats_for.split(",") if item)
    return {s: int(overrides.get(s, args.repeats)) for s in args.sizes.split(",")}


class Anchor:
    """The tf_keras child process: started first so its imports overlap ours, told to
    measure only once this process has finished measuring (never both at once)."""

    def __init__(self, args, repeats: dict[str, int], workdir: Path):
        self.sizes = args.sizes.split(",")
        self.out = workdir / "tf_keras.json"
        self.stderr_path = workdir / "tf_keras.log"
        command = [
            sys.executable,
            "-m",
            "benchmarks.tfkeras_anchor",
            "--sizes",
            args.sizes,
            "--repeats",
            str(args.repeats),
            "--repeats-for",
            ",".join(f"{k}={v}" for k, v in repeats.items()),
            "--workdir",
            str(workdir / "tf_keras"),
            "--out",
            str(self.out),
            "--wait-for-go",
        ]
        if args.quick:
            command.append("--no-warmup")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in results()
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            text=True,
        )

    def results(self, log) -> list[Result]:
        """Let the child measure, wait for it; an anchor that cannot run becomes n/a rows
        (tf_keras not installed) or explicit error rows (the child failed)."""
        try:
            self._send_go()
            returncode = self.proc.wait(timeout=ANCHOR_TIMEOUT)
            self.stderr.close()
            lines = self.stderr_path.read_text().splitlines()
            for line in lines:
                if line.startswith("  ["):
                    log(line)
            if returncode != 0:
                raise RuntimeError(f"exit code {returncode}: {lines[-1] if lines else ''}")
            payload = json.loads(self.out.read_text())
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
            self.proc.kill()
            why = f"tf_keras subprocess failed: {type(err).__name__}: {err}"[:300]
            log(f"  {why}")
            return self._rows(why, ERROR)
        if isinstance(payload, dict):  # {"unavailable": reason}: the extra is not installed
            log(f"  not available: {payload['unavailable']}")
            return self._rows(f"not available: {payload['unavailable']}", NA)
        return [Result.from_dict(d) for d in payload]

    def _send_go(self) -> None:
        """The child exits at once when tf_keras is missing, so its stdin may be closed
        already: that is not an error, its ``--out`` file says why."""
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def _rows(self, why: str, status: str) -> list[Result]:
        rows = []
        for size in self.sizes:
            for key, label in (("tf_keras.save", "tf_keras save"), ("tf_keras.load", "load")):
                row = not_available(size, key, label, why)
                row.status = status
                rows.append(row)
        return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    scratch = args.workdir is None  # ours to delete at the end
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="trainer-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    info = machine.describe(workdir)
    repeats = repeats_for(args)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message.strip()}", flush=True)

    log(f"workdir {workdir}; load average {info['load_before']}")
    anchor = None if args.skip_anchor else Anchor(args, repeats, workdir)
    from benchmarks import cases  # imports Keras 3: after argument errors are reported

    results: list[Result] = []
    if not args.quick:
        log("warm-up (untimed): every operation once on the tiny model")
        cases.measure_size(SIZES["tiny"], 1, workdir / "warmup", log=lambda _: None)
    for name in args.sizes.split(","):
        log(f"size {name}: {SIZES[name].description}, {repeats[name]} repeats")
        results += cases.measure_size(SIZES[name], repeats[name], workdir, log=log)
    if anchor is None:
        results += [
            not_available(s, k, label, "skipped (--skip-anchor)")
            for s in args.sizes.split(",")
            for k, label in (("tf_keras.save", "tf_keras save"), ("tf_keras.load", "tf_keras load"))
        ]
    else:
        log("tf_keras anchor (subprocess)")
        results += anchor.results(log)
    if not args.skip_training:
        from benchmarks import overhead

        training_repeats = args.training_repeats or (1 if args.quick else max(args.repeats, 3))
        log(f"training overhead, {training_repeats} runs per mode")
        results += overhead.measure(training_repeats, workdir, quick=args.quick, log=log)
    info["load_after"] = machine.load_average()
    info["duration"] = f"{time.perf_counter() - started:.0f} s"
    payload = {
        "machine": info,
        "command": command,
        "repeats": repeats,
        "quick": args.quick,
        "notes": args.note,
        "results": [r.to_dict() for r in results],
    }
    markdown = report.render(payload, analysis=HERE / "analysis.md")
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    if args.output:
        Path(args.output).write_text(markdown)
        log(f"report written to {args.output}")
    else:
        print(markdown)
    if scratch:
        shutil.rmtree(workdir, ignore_errors=True)
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
