"""``trainer inspect PATH``: describe a checkpoint of any backend, a serving export or a
legacy tf.keras SavedModel.

Why it loads the model: the layer tree, parameter counts and which layers were revived from
traced functions (rather than from their class) exist only once the checkpoint is rebuilt;
a serving export is described from its metadata and ``saved_model.pb`` alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainer._compat import keras as keras_compat
from trainer.cli.import_legacy import legacy_lines
from trainer.errors import TrainerError
from trainer.exports.exporter import is_export, read_export_metadata
from trainer.model_state.serving import format_signatures, model_signatures, saved_model_signatures
from trainer.save_backends import legacy, load_checkpoint
from trainer.save_backends.loading import fetch_remote
from trainer.storage.locations import is_remote
from trainer.tensorboard.board import LINK_KEY, tensorboard_command
from trainer.tensorboard.links import resolve_link


def run(args: argparse.Namespace) -> int:
    """``inspect PATH [--json]``; a URL is described from its verified local copy (the
    store's cache: the same download a load or a resume uses)."""
    path = fetch_remote(args.path) if is_remote(args.path) else args.path
    return run_inspect(path, as_json=args.json)


def run_inspect(path: Path, *, as_json: bool) -> int:
    """Describe a checkpoint, a serving export or a legacy tf.keras SavedModel."""
    if is_export(path):  # a serving export: metadata and signatures, no model loaded
        return inspect_export(path, as_json=as_json)
    if legacy.is_legacy(path):  # tf.keras' model.save(dir): what imports how
        return inspect_legacy(path, as_json=as_json)
    checkpoint = load_checkpoint(path, compile=True)
    report = describe(checkpoint)
    report.update(links_and_signatures(checkpoint))
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(format_report(report))
    return 0


def describe(checkpoint) -> dict[str, Any]:
    """What ``inspect`` reports about a loaded checkpoint, as JSON-ready values."""
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
        lines += format_links_and_signatures(report)
    return "\n".join(lines)


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
            tensorboard_command=tensorboard_command(resolved.run_dir),
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
        lines.append(f"  open with:    {link['tensorboard_command']}")
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
    """A serving export: its metadata, signatures and TensorBoard link; no model loaded."""
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


def inspect_legacy(path: Path, *, as_json: bool) -> int:
    """A legacy tf.keras SavedModel: what each layer imports from (``import-legacy``)."""
    report = legacy.describe(path)
    print(json.dumps(report, indent=2) if as_json else legacy_lines(report))
    return 0
