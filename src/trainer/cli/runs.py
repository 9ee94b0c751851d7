"""``trainer runs OUTPUT_DIR``: every run of an outputs directory with its sessions,
checkpoints, exports and TensorBoard log (``trainer.runs.index`` finds them).
"""

from __future__ import annotations

import argparse
import json

from trainer.runs.index import format_runs, list_runs


def run(args: argparse.Namespace) -> int:
    """``runs OUTPUT_DIR [--json]``."""
    listing = list_runs(args.output_dir)
    if args.json:
        print(json.dumps(listing, indent=2, sort_keys=True, default=str))
    else:
        print(format_runs(listing))
    return 0
