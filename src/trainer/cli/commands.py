"""The ``export`` and ``runs`` commands, and what ``inspect`` shows about links and signatures.

Kept apart from ``trainer.cli.app`` so that ``inspect`` of a plain checkpoint does not import
the export and TensorBoard machinery until it needs it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError
from trainer.model_state.serving import format_signatures, model_signatures, saved_model_signatures
from trainer.tensorboard.board import LINK_KEY, resolve_link


def run_export(args: argparse.Namespace) -> int:
    from trainer.exports.exporter import read_export_metadata
    from trainer.exports.sources import export_from_checkpoint

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


def run_runs(output_dir: Path, *, as_json: bool) -> int:
    from trainer.runs.index import format_runs, list_runs

    listing = list_runs(output_dir)
    if as_json:
        print(json.dumps(listing, indent=2, sort_keys=True, default=str))
    else:
        print(format_runs(listing))
    return 0


def link_report(path: Path, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The stored TensorBoard link plus whether (and where) it resolves."""
    link = metadata.get(LINK_KEY)
    if not isinstance(link, dict):
        return None
    report = dict(link)
    try:
        resolved = resolve_link(path, metadata)
    except TrainerError as error:
        report.update(resolves=False, problem=str(error))
    else:
        report.update(
            resolves=True,
            event_file_path=str(resolved.event_file),
            log_dir_path=str(resolved.log_dir),
            tags_at_step=resolved.tags,
        )
    return report


def links_and_signatures(checkpoint: Any) -> dict[str, Any]:
    """For ``inspect`` of a checkpoint: its TB link and its (or its export's) signatures."""
    path = Path(checkpoint.path)
    if (path / "saved_model.pb").is_file():
        signatures, source = saved_model_signatures(path), "saved_model.pb"
    else:
        try:
            signatures = model_signatures(checkpoint.model)
            source = (
                "the model, traced as a format=keras export serves it (the default "
                "export, format=savedmodel, can name and type its inputs differently)"
            )
        except TrainerError as error:
            signatures, source = {}, f"unavailable: {error}"
        except Exception as error:  # the model's own call, traced: user code
            signatures, source = {}, f"unavailable: {type(error).__name__}: {error}"
    return {
        "tensorboard": link_report(path, checkpoint.metadata),
        "signatures": signatures,
        "signatures_source": source,
    }


def format_links_and_signatures(report: dict[str, Any]) -> list[str]:
    lines = [f"signatures:     from {report.get('signatures_source', 'saved_model.pb')}"]
    lines += [f"  {line}" for line in format_signatures(report["signatures"])] or ["  none"]
    link = report.get("tensorboard")
    if not link:
        lines.append("tensorboard:    no link (saved without a RunBoard)")
        return lines
    lines.append(
        f"tensorboard:    run {link.get('run_name')} step {link.get('step')}, tag {link.get('tag')}"
        + (f" (no log of its own: the link of {link['via']})" if link.get("via") else "")
    )
    if link["resolves"]:
        lines.append(f"  event file:   {link['event_file_path']}")
        lines.append(f"  open with:    tensorboard --logdir {link['log_dir_path']}")
    else:
        lines.append(f"  BROKEN:       {link['problem']}")
    return lines


def _source_link(meta: dict[str, Any]) -> dict[str, Any] | None:
    """For an export written without a TensorBoard log of its own (``trainer export``
    without ``--tensorboard``): the link of the checkpoint it was made from, resolved from
    that checkpoint's location (``source.checkpoint``), where it was written."""
    link = meta.get("checkpoint_tensorboard")
    source = (meta.get("source") or {}).get("checkpoint")
    if not isinstance(link, dict) or not source:
        return None
    report = link_report(Path(source), {LINK_KEY: link})
    if report is not None:
        report["via"] = f"the source checkpoint {source}"
    return report


def inspect_export(path: Path, *, as_json: bool) -> int:
    from trainer.exports.exporter import read_export_metadata

    meta = read_export_metadata(path)
    state = meta.get("state") or {}
    report = {
        "path": str(path),
        "kind": "export",
        "version": meta.get("version"),
        "exported_with": meta.get("exported_with"),
        "created": meta.get("created"),
        "model": meta.get("model_name"),
        "source": meta.get("source"),
        "epoch": state.get("epoch"),
        "global_step": state.get("global_step"),
        "metrics": state.get("metrics") or {},
        "warmup_requests": meta.get("warmup_requests", 0),
        "signatures": saved_model_signatures(path),
        "signatures_source": "saved_model.pb",
        "tensorboard": link_report(path, meta) or _source_link(meta),
    }
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
        return 0
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in report["metrics"].items()) or "none"
    source = (report["source"] or {}).get("checkpoint") or "training run"
    print(
        "\n".join(
            [
                f"path:           {report['path']}",
                f"export:         version {report['version']} ({report['exported_with']})",
                f"created:        {report['created']}",
                f"from:           {source}",
                f"epoch / step:   {report['epoch']} / {report['global_step']}",
                f"metrics:        {metrics}",
                f"model:          {report['model']}",
                f"warmup:         {report['warmup_requests']} request(s)",
                *format_links_and_signatures(report),
            ]
        )
    )
    return 0


def is_legacy(path: Path) -> bool:
    from trainer.save_backends import legacy

    return legacy.is_legacy(path)


def run_import_legacy(src: Path, dst: Path, backend: str, as_json: bool) -> int:
    """``import-legacy``: a legacy tf.keras SavedModel -> a trainer checkpoint at ``dst``."""
    from trainer.errors import NotACheckpointError
    from trainer.save_backends import get_backend, legacy

    if not legacy.is_legacy(src):
        raise NotACheckpointError(
            f"{src} is not a legacy tf.keras SavedModel (it needs saved_model.pb and "
            f"keras_metadata.pb, and no trainer metadata). Pass the directory TensorFlow "
            f"2.x's model.save(dir) wrote. Received: {str(src)!r}"
        )
    checkpoint = legacy.load_legacy(src)
    written = get_backend(backend).save(checkpoint.model, dst, metadata=checkpoint.metadata)
    report = {"source": str(src), "checkpoint": str(written), "backend": backend}
    report.update(checkpoint.metadata)
    print(json.dumps(report, indent=2) if as_json else _legacy_lines(report))
    return 0


def inspect_legacy(path: Path, *, as_json: bool) -> int:
    from trainer.save_backends import legacy

    report = legacy.describe(path)
    print(json.dumps(report, indent=2) if as_json else _legacy_lines(report))
    return 0


def _legacy_lines(report: dict) -> str:
    lines = []
    for key, value in report.items():
        if key == "layers":
            lines.append("layers:")
            lines += [f"  {x['name']} ({x['class_name']}): from {x['imports_from']}" for x in value]
        elif key == "legacy_layers":
            lines.append("layers: " + ", ".join(f"{k} from {v}" for k, v in value.items()))
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
