"""``trainer export CHECKPOINT OUT_DIR``: a serving export of a checkpoint of any backend.

Named for what it exports: a module ``export`` here would sit one letter from the
``trainer.exports`` package it calls (tests/package/test_layout.py refuses such pairs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from trainer.exports.exporter import read_export_metadata
from trainer.exports.sources import export_from_checkpoint
from trainer.storage.locations import is_remote
from trainer.storage.store import Store
from trainer.tensorboard.board import LINK_KEY
from trainer.training.store_sync import publish_export


def run(args: argparse.Namespace) -> int:
    """``export CHECKPOINT OUT_DIR [options]``: write the next version, report it. An
    ``OUT_DIR`` URL: the version is written in a local temporary directory (as on disk:
    sealed, then renamed), then published at the URL (``store_sync.publish_export``:
    objects, ``saved_model.pb``, the commit marker last, ``latest``), the next free
    version number there; ``--keep`` applies to the store's versions."""
    if is_remote(args.out_dir):  # a wrong scheme, bucket or endpoint: before exporting
        Store(str(args.out_dir)).check_bucket()
    with tempfile.TemporaryDirectory(prefix="trainer-export-") as staging:
        local_out = Path(staging) if is_remote(args.out_dir) else args.out_dir
        path = export_from_checkpoint(
            args.checkpoint,
            local_out,
            keep=args.keep,
            warmup=args.warmup,
            format=args.format,
            tensorboard=args.tensorboard,
            with_optimizer=args.with_optimizer,
        )
        meta = read_export_metadata(path)
        where = str(path)
        if is_remote(args.out_dir):
            state = meta.get("state") or {}
            where = publish_export(
                str(args.out_dir),
                path,
                step=int(state.get("global_step") or 0),
                keep=args.keep,
            )
    report = {
        "export": where,
        "version": meta["version"],
        "exported_with": meta["exported_with"],
        "warmup_requests": meta["warmup_requests"],
        "tensorboard": meta.get(LINK_KEY),
    }
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        link = report["tensorboard"]
        print(f"exported {args.checkpoint} -> {where} ({meta['exported_with']})")
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
