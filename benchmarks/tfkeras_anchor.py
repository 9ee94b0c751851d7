"""The tf_keras 2.21 anchor process: ``python -m benchmarks.tfkeras_anchor``.

Started by ``benchmarks.run`` in a process of its own (tf_keras and Keras 3 interfere in one
process). tf_keras is an optional extra, so this entry point imports it only inside
``main``: when it cannot be imported, the child says so in its ``--out`` file and exits at
once, and the parent reports the anchor rows as not available instead of failing.
Results go to ``--out`` as JSON: a list of rows, or ``{"unavailable": reason}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

INSTALL_HINT = "install it with: pip install -e '.[bench]'"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--repeats-for", default="", help="name=n,... per-size overrides")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument(
        "--wait-for-go",
        action="store_true",
        help="import, then wait for a line on stdin before measuring: the parent overlaps "
        "the slow imports with its own but never its measurements",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from benchmarks import tfkeras_cases
    except ImportError as error:  # the optional extra is missing: a fact, not a failure
        reason = f"tf_keras cannot be imported ({type(error).__name__}: {error}); {INSTALL_HINT}"
        Path(args.out).write_text(json.dumps({"unavailable": reason}))
        return 0
    if args.wait_for_go:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
    overrides = dict(item.split("=") for item in args.repeats_for.split(",") if item)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="tfk-bench-"))
    if not args.no_warmup:
        tfkeras_cases.warm_up(root)
    results = []
    for name in args.sizes.split(","):
        repeats = int(overrides.get(name, args.repeats))
        for result in tfkeras_cases.measure_size(tfkeras_cases.SIZES[name], repeats, root / name):
            results.append(result.to_dict())
            shown = f"{result.median:.3f}s" if result.median is not None else result.status
            print(f"  [{name}] {result.label}: {shown} {result.note}", file=sys.stderr)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
