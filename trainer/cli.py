"""``python -m trainer``: inspect and verify checkpoints, export them for serving, list runs.

Every deliberate error (``TrainerError``) becomes one line on stderr and exit code 2;
nothing here prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="describe a checkpoint of any backend")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    export = commands.add_parser(
        "export", help="export a checkpoint of any backend as OUT_DIR/<version>/ for serving"
    )
    export.add_argument("checkpoint", type=Path)
    export.add_argument("out_dir", type=Path)
    export.add_argument("--keep", type=int, default=5, help="versions kept (default 5)")
    export.add_argument("--format", choices=["auto", "keras", "savedmodel"], default="auto")
    export.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="TF Serving warmup requests from N validation examples of the run's data",
    )
    export.add_argument(
        "--no-card", action="store_true", help="do not add an export card to the run's log"
    )
    export.add_argument("--json", action="store_true", help="machine-readable output")
    runs = commands.add_parser("runs", help="list every run with its checkpoints and exports")
    runs.add_argument("output_dir", type=Path)
    runs.add_argument("--json", action="store_true", help="machine-readable output")
    verify = commands.add_parser(
        "verify", help="check every file of a checkpoint against its manifest, then load it"
    )
    verify.add_argument("path", type=Path)
    verify.add_argument("--files-only", action="store_true", help="do not rebuild the model")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return run_inspect(args.path, as_json=args.json)
        if args.command == "verify":
            return run_verify(args.path, load=not args.files_only, as_json=args.json)
        if args.command in ("export", "runs"):
            from trainer import cli_extra

            if args.command == "export":
                return cli_extra.run_export(args)
            return cli_extra.run_runs(args.output_dir, as_json=args.json)
    except (TrainerError, OSError) as error:
        message = " ".join(str(error).split())  # one line, even for multi-line causes
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


def run_verify(path: Path, *, load: bool, as_json: bool) -> int:
    from trainer.verify import format_report, verify_checkpoint

    report = verify_checkpoint(path, load=load)
    print(json.dumps(report, indent=2, sort_keys=True) if as_json else format_report(report))
    return 0


def run_inspect(path: Path, *, as_json: bool) -> int:
    from trainer import cli_extra
    from trainer.export import is_export
    from trainer.save_backends import load_checkpoint

    if is_export(path):  # a serving export: metadata and signatures, no model loaded
        return cli_extra.inspect_export(path, as_json=as_json)
    checkpoint = load_checkpoint(path, compile=True)
    report = describe(checkpoint)
    report.update(cli_extra.links_and_signatures(checkpoint))
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_report(report))
    return 0


def describe(checkpoint) -> dict[str, Any]:
    meta = checkpoint.metadata
    state = checkpoint.state
    return {
        "path": str(checkpoint.path),
        "backend": meta.get("backend"),
        "format_version": meta.get("format_version"),
        "created": meta.get("created"),
        "epoch": state.epoch,
        "global_step": state.global_step,
        "step_in_epoch": state.step_in_epoch,
        "metrics": state.metrics,
        "model": checkpoint.model.name,
        "model_class": type(checkpoint.model).__name__,
        "num_params": int(checkpoint.model.count_params()),
        "layers": layer_tree(checkpoint.model),
    }


def layer_tree(layer) -> list[dict[str, Any]]:
    """Direct sublayers of ``layer`` with parameter counts, recursively."""
    from trainer._compat import keras as keras_compat

    children = []
    for child in keras_compat.sublayers(layer, recursive=False):
        children.append(
            {
                "name": child.name,
                "class": type(child).__name__,
                "params": int(child.count_params()) if child.built else 0,
                "layers": layer_tree(child),
            }
        )
    return children


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"path:           {report['path']}",
        f"backend:        {report['backend']} (format version {report['format_version']})",
        f"created:        {report['created']}",
        f"epoch / step:   {report['epoch']} / {report['global_step']}"
        + (f" (+{report['step_in_epoch']} in epoch)" if report["step_in_epoch"] else ""),
        "metrics:        "
        + (", ".join(f"{k}={v:.4g}" for k, v in report["metrics"].items()) or "none"),
        f"model:          {report['model']} ({report['model_class']}), "
        f"{report['num_params']:,} parameters",
        "layers:",
    ]

    def walk(nodes: list[dict[str, Any]], depth: int) -> None:
        for node in nodes:
            lines.append(f"{'  ' * depth}- {node['name']} ({node['class']}): {node['params']:,}")
            walk(node["layers"], depth + 1)

    walk(report["layers"], 1)
    if "signatures" in report:
        from trainer import cli_extra

        lines += cli_extra.format_links_and_signatures(report)
    return "\n".join(lines)
