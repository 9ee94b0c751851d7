"""``trainer`` / ``python -m trainer``: the argument parser, and the dispatch of each
command to its own module.

Why only these: ``--help`` and a usage error must answer at once, so this module imports
nothing heavy; each command's module (``COMMANDS``) is imported when it runs, after
TensorFlow is quieted. Every deliberate error (``TrainerError``) becomes one line on stderr
and exit code 2; nothing here prints a traceback for bad input. The help is plain text
written for the terminal (``DESCRIPTION``), not this docstring.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
from pathlib import Path

from trainer.errors import TrainerError, UnsafeCheckpointError, UnsupportedLocationError
from trainer.storage.locations import is_remote, local_path

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
# Each command's module: ``run(args) -> exit code``; ``python_call(args)`` if the Python
# equivalent of the command is not a plain ``load_checkpoint`` (see ``unsafe_advice``).
COMMANDS = {
    "inspect": "trainer.cli.inspect",
    "verify": "trainer.cli.verify",
    "export": "trainer.cli.export_checkpoint",
    "import-legacy": "trainer.cli.import_legacy",
    "runs": "trainer.cli.runs",
}
CHECKPOINT_HELP = (
    "a checkpoint of any backend (directory or .h5 file), e.g. a run's checkpoints/latest"
)
STORE_HELP = "; or on object storage: s3:// or gs://<checkpoint dir>/<name> or .../latest"


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

    def command(name: str, summary: str, *positionals: tuple) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=summary,
            description=textwrap.fill(summary[0].upper() + summary[1:] + ".", width=88),
            epilog=f"example:\n  {EXAMPLES[name].format(prog=prog)}",
            formatter_class=formatter,
        )
        for dest, text, *kind in positionals:  # (dest, help[, type]): a local path by default
            sub.add_argument(dest, type=kind[0] if kind else _local, help=text)
        sub.add_argument("--json", action="store_true", help="print machine-readable JSON")
        return sub

    _add_commands(command)
    return parser


def _local(text: str) -> Path:
    """A path argument; a URL (``s3://...``) is refused by argparse (exit 2) with the
    reason, instead of being taken for a local folder named ``s3:``."""
    try:
        return local_path(text, "path")
    except UnsupportedLocationError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _local_or_url(text: str) -> Path | str:
    """A path argument that may also be an object-storage URL, kept as the URL: the
    command fetches the checkpoint (``trainer.save_backends.loading.fetch_remote``); an
    unsupported scheme is refused there with one line."""
    return text if is_remote(text) else _local(text)


def _add_commands(command) -> None:
    """Every command, through ``command(name, summary, *positionals)`` (``build_parser``)."""
    command(
        "inspect",
        "describe a checkpoint or serving export: backend, step, metrics, signatures and "
        "the layer tree (layers revived from traced functions are marked)",
        ("path", CHECKPOINT_HELP + ", or a serving export's version directory" + STORE_HELP,
         _local_or_url),
    )  # fmt: skip
    verify = command(
        "verify",
        "check every file of a checkpoint or serving export against its manifest, then "
        "load it (an export: load and answer serving_default, count its warmup requests)",
        ("path", CHECKPOINT_HELP + ", or a serving export's version directory" + STORE_HELP,
         _local_or_url),
    )  # fmt: skip
    verify.add_argument(
        "--files-only", action="store_true", help="check the files only; do not rebuild the model"
    )
    export = command(
        "export",
        "export a checkpoint of any backend as OUT_DIR/<version>/ for serving",
        ("checkpoint", CHECKPOINT_HELP + STORE_HELP, _local_or_url),
        (
            "out_dir",
            "directory of numbered versions (created if missing); or a URL on "
            "object storage (s3:// or gs://bucket/serving/model), where each version is published "
            "complete, by a commit marker written last",
            _local_or_url,
        ),
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
        (
            "output_dir",
            "a Hydra outputs directory (outputs/, multirun/) or a run; or a "
            "prefix on object storage (s3:// or gs://bucket/runs), listed from its commit markers",
            _local_or_url,
        ),
    )


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
        type=_local_or_url,
        metavar="DIR",
        help="write the export's card and graph into a TensorBoard log in DIR, a directory "
        "or an s3:// or gs:// URL (default: no log is written; the checkpoint's own run is "
        "only ever read)",
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
    from trainer.console import quiet_tensorflow, reader_gone

    quiet_tensorflow()  # every command imports TensorFlow
    module = None
    try:
        module = importlib.import_module(COMMANDS[args.command])
        return module.run(args)
    except BrokenPipeError:  # `trainer runs out | head`: the reader has all it wanted
        return reader_gone()
    except (TrainerError, OSError) as error:
        text = None
        if isinstance(error, UnsafeCheckpointError):
            text = unsafe_advice(args, error, getattr(module, "python_call", None))
        message = " ".join((text or str(error)).split())  # one line, even for multi-line causes
        print(f"error: {message}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets the verdict too
            print(json.dumps({"ok": False, "error": type(error).__name__, "message": message}))
        return EXIT_USAGE


def unsafe_advice(
    args: argparse.Namespace, error: UnsafeCheckpointError, python_call=None
) -> str | None:
    """A lambda refused in safe mode, with advice the CLI user can act on: the library's
    says "load with safe_mode=False", which no command has (the CLI never runs code from
    a checkpoint), so name the Python call that does what the command did
    (``python_call(args)`` of the command's module, else a plain ``load_checkpoint``)."""
    if not error.received:  # not the refusal of a stored lambda: its own message
        return None
    if python_call is not None:
        call = python_call(args)
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
