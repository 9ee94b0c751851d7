"""``trainer runs OUTPUT_DIR``: every run of an outputs directory with its sessions,
checkpoints, exports and TensorBoard log (``trainer.runs.index`` finds them); on object
storage (``trainer runs s3://bucket/runs``), the runs' checkpoints and export versions
from their commit markers (``trainer.runs.store_listing``).
"""

from __future__ import annotations

import argparse
import json

from trainer.runs.index import format_runs, list_runs
from trainer.runs.store_listing import format_store_runs, list_store_runs
from trainer.storage.locations import is_remote


def run(args: argparse.Namespace) -> int:
    """``runs OUTPUT_DIR [--json]``."""
    remote = is_remote(args.output_dir)
    listing = list_store_runs(args.output_dir) if remote else list_runs(args.output_dir)
    if args.json:
        print(json.dumps(listing, indent=2, sort_keys=True, default=str))
    else:
        print(format_store_runs(listing) if remote else format_runs(listing))
    return 0
