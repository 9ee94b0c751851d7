"""``trainer`` / ``python -m trainer``: inspect and verify checkpoints, export them for
serving, list runs.

Every deliberate error (``TrainerError``) becomes one line on stderr and exit code 2;
nothing here prints a traceback for bad input. The help is plain text written for the
terminal (``DESCRIPTION``), not this docstring.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError, UnsafeCheckpointError

EXIT_USAGE = 2

DESCRIPTION = """\
Inspect and verify trainer checkpoints (any save backend), export them for serving, and
list the runs of an outputs directory. A bad path or an unreadable checkpoint gives one
"error:" line and exit code 2."""

EXAMPLES = {
    "inspect": "{prog} inspect outputs/2026-01-31/12-00-00/checkpoints/latest",
    "import-legacy": "{prog} import-legacy old_tf2_model/ checkpoints/imported",
    "verify": "{prog} verify outputs/2026-01-31/12-00-00/checkpoints/latest",
    "export": "{prog} export outputs/2026-01-31/12-00-00/checkpoints/latest serving/digits",
    "runs": "{prog} runs outputs",
}
CHECKPOINT_HELP = (
    "a checkpoint of any backend (directory or .h5 file), e.g. a run's checkpoints/latest"
)


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The command-line interface, with a description, every argument explained and an
    example for each command (``--help`` of the program and of each command)."""
    formatter = argparse.RawDescriptionHelpFormatter
    examples = "\n".join(f"  {e.format(prog=prog)}" for e in EXAMPLES.values())
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=f"examples:\n{examples}",
        formatter_class=formatter,
    )
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="one of the commands below; COMMAND --help explains its arguments",
    )

    def command(name: str, summary: str, *positionals: tuple[str, str]) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=summary,
            description=textwrap.fill(summary[0].upper() + summary[1:] + ".", width=88),
            epilog=f"example:\n  {EXAMPLES[name].format(prog=prog)}",
            formatter_class=formatter,
        )
        for dest, text in positionals:
            sub.add_argument(dest, type=Path, help=text)
        sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
        return sub

    command(
        "inspect",
        "describe a checkpoint or serving export: backend, step, metrics, signatures and "
        "the layer tree (layers revived from traced functions are marked)",
        ("path", CHECKPOINT_HELP + ", or a serving export's version directory"),
    )
    verify = command(
        "verify",
        "check every file of a checkpoint or serving export against its manifest, then "
        "load it (an export: load and answer serving_default, count its warmup requests)",
        ("path", CHECKPOINT_HELP + ", or a serving export's version directory"),
    )
    verify.add_argument(
        "--files-only", action="store_true", help="check the files only; do not rebuild the model"
    )
    export = command(
        "export",
        "export a checkpoint of any backend as OUT_DIR/<version>/ for serving",
        ("checkpoint", CHECKPOINT_HELP),
        ("out_dir", "directory of numbered versions (created if missing)"),
    )
    _add_export_options(export)
    legacy = command(
        "import-legacy",
        "convert a legacy tf.keras SavedModel (TensorFlow 2.x model.save) into a trainer "
        "checkpoint holding a compiled, trainable Keras 3 model",
        ("src", "the directory tf.keras' model.save(dir) wrote"),
        ("dst", "the checkpoint to write (must not exist)"),
    )
    legacy.add_argument(
        "--backend", default="savedmodel", help="save backend of DST (default savedmodel)"
    )
    command(
        "runs",
        "list every run with its checkpoints, exports and TensorBoard log",
        ("output_dir", "a Hydra outputs directory (outputs/, multirun/) or a run"),
    )
    return parser


def _add_export_options(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "--keep", type=int, default=5, metavar="N", help="newest versions kept (default 5)"
    )
    export.add_argument(
        "--format",
        choices=["auto", "keras", "savedmodel"],
        default="auto",
        help="savedmodel: a trainer SavedModel (servable, and revivable as a trainable "
        "model); keras: Keras's lean inference-only export; auto: savedmodel if its "
        "backend can be imported, else keras (default auto)",
    )
    export.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="TF Serving warmup requests from N validation examples of the run's data "
        "(at most 1000: TF Serving does not load a version with more)",
    )
    export.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help="write the export's card and graph into a TensorBoard log in DIR (default: no "
        "log is written; the checkpoint's own run is only ever read)",
    )
    export.add_argument(
        "--with-optimizer",
        action="store_true",
        help="keep the compile state, optimizer slots and training traces (savedmodel "
        "format; default: an inference-only export, about the size of Keras's model.export)",
    )
    # Accepted for old scripts: writing no card is now the default.
    export.add_argument("--no-card", action="store_true", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None, prog: str = "trainer") -> int:
    """Run one command; ``prog`` is how the user started it (``python -m trainer`` passes
    its own), so usage lines name a command that works."""
    args = build_parser(prog).parse_args(argv)
    from trainer.console import quiet_tensorflow

    quiet_tensorflow()  # every command below imports TensorFlow
    try:
        if args.command == "inspect":
            return run_inspect(args.path, as_json=args.json)
        if args.command == "verify":
            return run_verify(args.path, load=not args.files_only, as_json=args.json)
        from trainer.cli import commands

        if args.command == "export":
            return commands.run_export(args)
        if args.command == "import-legacy":
            return commands.run_import_legacy(args.src, args.dst, args.backend, args.json)
        return commands.run_runs(args.output_dir, as_json=args.json)
    except (TrainerError, OSError) as error:
        text = unsafe_advice(args, error) if isinstance(error, UnsafeCheckpointError) else None
        message = " ".join((text or str(error)).split())  # one line, even for multi-line causes
        print(f"error: {message}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets the verdict too
            print(json.dumps({"ok": False, "error": type(error).__name__, "message": message}))
        return EXIT_USAGE


def unsafe_advice(args: argparse.Namespace, error: UnsafeCheckpointError) -> str | None:
    """A lambda refused in safe mode, with advice the CLI user can act on: the library's
    says "load with safe_mode=False", which no command has (the CLI never runs code from
    a checkpoint), so name the Python call that does what the command did."""
    if not error.received:  # not the refusal of a stored lambda: its own message
        return None
    if args.command == "export":
        options = {
            "keep": (args.keep, 5),
            "warmup": (args.warmup, 0),
            "format": (args.format, "auto"),
            "tensorboard": (str(args.tensorboard) if args.tensorboard else None, None),
            "with_optimizer": (args.with_optimizer, False),
        }
        extra = "".join(f", {k}={v!r}" for k, (v, default) in options.items() if v != default)
        call = (
            f"from trainer.exports.sources import export_from_checkpoint; "
            f"export_from_checkpoint({str(args.checkpoint)!r}, {str(args.out_dir)!r}{extra}, "
            f"safe_mode=False)"
        )
    else:
        path = getattr(args, "path", None) or getattr(args, "src", "CHECKPOINT")
        call = (
            f"from trainer.save_backends import load_checkpoint; "
            f"load_checkpoint({str(path)!r}, safe_mode=False).model.summary()"
        )
    return (
        f"{error.problem} The trainer CLI never runs code stored in a checkpoint and has no "
        f"option to; if you trust its source, run the same from Python, which does: "
        f'python -c "{call}". Received: {error.received.split(". ")[0]}'
    )


def run_verify(path: Path, *, load: bool, as_json: bool) -> int:
    from trainer.cli.verify import format_report, verify_checkpoint

    report = verify_checkpoint(path, load=load)
    print(json.dumps(report, indent=2, sort_keys=True) if as_json else format_report(report))
    return 0


def run_inspect(path: Path, *, as_json: bool) -> int:
    from trainer.cli import commands
    from trainer.exports.exporter import is_export
    from trainer.save_backends import load_checkpoint

    if is_export(path):  # a serving export: metadata and signatures, no model loaded
        return commands.inspect_export(path, as_json=as_json)
    if commands.is_legacy(path):  # tf.keras' model.save(dir): what imports how
        return commands.inspect_legacy(path, as_json=as_json)
    checkpoint = load_checkpoint(path, compile=True)
    report = describe(checkpoint)
    report.update(commands.links_and_signatures(checkpoint))
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_report(report))
    return 0


def describe(checkpoint) -> dict[str, Any]:
    meta = checkpoint.metadata
    state = checkpoint.state
    how = meta.get("revived_from") if isinstance(meta.get("revived_from"), dict) else {}
    model = checkpoint.model
    return {
        "path": str(checkpoint.path),
        "backend": meta.get("backend"),
        "format_version": meta.get("format_version"),
        "created": meta.get("created"),
        "epoch": state.epoch,
        "global_step": state.global_step,
        "step_in_epoch": state.step_in_epoch,
        "metrics": state.metrics,
        "model": model.name,
        "model_class": type(model).__name__,
        "num_params": int(model.count_params()),
        **({"revived_from": how[model.name]} if model.name in how else {}),
        "layers": layer_tree(model, how),
    }


def layer_tree(layer, how: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Direct sublayers of ``layer`` with parameter counts, recursively; with ``how``
    (the SavedModel backend's ``revived_from``: layer name -> ``config`` | ``graph`` |
    ``traced``) each node says how it was rebuilt."""
    from trainer._compat import keras as keras_compat

    how = how or {}
    children = []
    for child in keras_compat.sublayers(layer, recursive=False):
        node = {
            "name": child.name,
            "class": type(child).__name__,
            "params": int(child.count_params()) if child.built else 0,
        }
        if child.name in how:
            node["revived_from"] = how[child.name]
        node["layers"] = layer_tree(child, how)
        children.append(node)
    return children


# A layer revived from its traced functions: its class was missing, its code refused in
# safe mode, or its config could not be rebuilt. It computes what was saved, but none of
# the class's Python (custom methods, attributes) is there.
TRACED_MARK = "[revived from traced functions: its class was not used]"


def _traced_names(nodes: list[dict[str, Any]]) -> list[str]:
    names = []
    for node in nodes:
        if node.get("revived_from") == "traced":
            names.append(node["name"])
        names += _traced_names(node["layers"])
    return names


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
        f"{report['num_params']:,} parameters"
        + (f" {TRACED_MARK}" if report.get("revived_from") == "traced" else ""),
    ]
    traced = _traced_names(report["layers"])
    if traced:
        lines.append(
            f"revived:        {len(traced)} layer(s) from traced functions, not from their "
            f"class: {', '.join(traced)}"
        )
    lines.append("layers:")

    def walk(nodes: list[dict[str, Any]], depth: int) -> None:
        for node in nodes:
            mark = f"  {TRACED_MARK}" if node.get("revived_from") == "traced" else ""
            lines.append(
                f"{'  ' * depth}- {node['name']} ({node['class']}): {node['params']:,}{mark}"
            )
            walk(node["layers"], depth + 1)

    walk(report["layers"], 1)
    if "signatures" in report:
        from trainer.cli import commands

        lines += commands.format_links_and_signatures(report)
    return "\n".join(lines)
