"""``trainer export CHECKPOINT OUT_DIR``: a serving export of a checkpoint of any backend.

Named for what it exports: a module ``export`` here would sit one letter from the
``trainer.exports`` package it calls (tests/package/test_layout.py refuses such pairs).
"""

from __future__ import annotations

import argparse
import json

from trainer.exports.exporter import read_export_metadata
from trainer.exports.sources import export_from_checkpoint
from trainer.tensorboard.board import LINK_KEY


def run(args: argparse.Namespace) -> int:
    """``export CHECKPOINT OUT_DIR [options]``: write the next version, report it."""
    path = export_from_checkpoint(
        args.checkpoint,
        args.out_dir,
        keep=args.keep,
        warmup=args.warmup,
        format=args.format,
        tensorboard=args.tensorboard,
        with_optimizer=args.with_optimizer,
    )
    meta = read_export_metadata(path)
    report = {
        "export": str(path),
        "version": meta["version"],
        "exported_with": meta["exported_with"],
        "warmup_requests": meta["warmup_requests"],
        "tensorboard": meta.get(LINK_KEY),
    }
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        link = report["tensorboard"]
        print(f"exported {args.checkpoint} -> {path} ({meta['exported_with']})")
        print(f"warmup requests: {meta['warmup_requests']}")
        if link:
            print(f"tensorboard: run {link['run_name']} step {link['step']} ({link['tag']})")
    return 0


def python_call(args: argparse.Namespace) -> str:
    """The Python call that does what the command did, with ``safe_mode=False`` (for a
    checkpoint whose lambdas the CLI refuses to run)."""
    options = {
        "keep": (args.keep, 5),
        "warmup": (args.warmup, 0),
        "format": (args.format, "auto"),
        "tensorboard": (str(args.tensorboard) if args.tensorboard else None, None),
        "with_optimizer": (args.with_optimizer, False),
    }
    extra = "".join(f", {k}={v!r}" for k, (v, default) in options.items() if v != default)
    return (
        f"from trainer.exports.sources import export_from_checkpoint; "
        f"export_from_checkpoint({str(args.checkpoint)!r}, {str(args.out_dir)!r}{extra}, "
        f"safe_mode=False)"
    )
