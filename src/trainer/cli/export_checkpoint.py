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
from trainer.training.store_sync import EventSync, publish_export


def run(args: argparse.Namespace) -> int:
    """``export CHECKPOINT OUT_DIR [options]``: write the next version, report it. An
    ``OUT_DIR`` URL: the version is written in a local temporary directory (as on disk:
    sealed, then renamed), then published at the URL (``store_sync.publish_export``:
    objects, ``saved_model.pb``, the commit marker last, ``latest``), the next free
    version number there; ``--keep`` applies to the store's versions. A ``--tensorboard``
    URL: the card and graph are written into a local temporary log, which is then
    uploaded beside the log's other event files (``store_sync.EventSync``); the export's
    link records the log's URL, and its card the version's URL when it is on a store."""
    out_url = str(args.out_dir) if is_remote(args.out_dir) else None
    tb_url = str(args.tensorboard).rstrip("/") if is_remote(args.tensorboard) else None
    for url in (out_url, tb_url):  # a wrong scheme, bucket or endpoint: before exporting
        if url is not None:
            Store(url).check_bucket()
    with tempfile.TemporaryDirectory(prefix="trainer-export-") as staging:
        local_out = Path(staging) / "export" if out_url else args.out_dir
        local_tb = Path(staging) / "tb" if tb_url else args.tensorboard
        published: list[str] = []

        def publish(version: Path) -> str | None:
            if out_url is None:
                return None
            state = read_export_metadata(version).get("state") or {}
            step = int(state.get("global_step") or 0)
            published.append(publish_export(out_url, version, step=step, keep=args.keep))
            return published[-1]

        path = export_from_checkpoint(
            args.checkpoint,
            local_out,
            keep=args.keep,
            warmup=args.warmup,
            format=args.format,
            tensorboard=local_tb,
            with_optimizer=args.with_optimizer,
            log_url=tb_url,
            publish=publish,
        )
        meta = read_export_metadata(path)
        if tb_url is not None:
            EventSync(tb_url, local_tb).final(failing=False)
    where = published[-1] if published else str(path)
    _report(args, where, meta, tb_url)
    return 0


def _report(args: argparse.Namespace, where: str, meta: dict, tb_url: str | None) -> None:
    report = {
        "export": where,
        "version": meta["version"],
        "exported_with": meta["exported_with"],
        "warmup_requests": meta["warmup_requests"],
        "tensorboard": meta.get(LINK_KEY),
    }
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return
    link = report["tensorboard"]
    print(f"exported {args.checkpoint} -> {where} ({meta['exported_with']})")
    print(f"warmup requests: {meta['warmup_requests']}")
    if link:
        print(f"tensorboard: run {link['run_name']} step {link['step']} ({link['tag']})")
    if tb_url is not None:
        print(f"tensorboard log: {tb_url}")


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
