"""``trainer verify PATH``: check a checkpoint or a serving export completely.

Stronger than ``load``: every file's SHA-256 is compared with the manifest, files added
after the save are reported, and the model is then rebuilt (unless ``--files-only``), so a
checkpoint that verifies is one that loads and holds exactly what was written. A serving
export (``export/<version>``) is checked against the manifest written last over all its
files (metadata and warmup requests included); it then has to load with TensorFlow, offer
every signature its metadata names, answer ``serving_default``, and hold as many warmup
requests as recorded (and, for a ``savedmodel`` export, revive as a checkpoint too).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import tensorflow as tf

from trainer.errors import CorruptCheckpointError, IntegrityError
from trainer.exports.warmup import EXPORT_FILE, EXPORT_MANIFEST, EXTRA_DIR, count_warmup
from trainer.model_state.serving import SERVING_KEY
from trainer.save_backends import detect_backend
from trainer.save_backends.loading import fetch_remote
from trainer.storage import integrity
from trainer.storage.locations import is_remote, local_path


def run(args: argparse.Namespace) -> int:
    """``verify PATH [--files-only] [--json]``. A URL: its objects are checked against
    the commit marker's sizes and SHA-256 while downloaded (``fetch_remote``), then the
    local copy is verified as any checkpoint (manifest, then the load)."""
    path = fetch_remote(args.path) if is_remote(args.path) else args.path
    report = verify_checkpoint(path, load=not args.files_only)
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
    return 0


def verify_checkpoint(path: str | Path, *, load: bool = True) -> dict[str, Any]:
    """Verify ``path``; returns a report, raises a ``TrainerError`` at the first problem."""
    path = local_path(path, "path")
    target = path.resolve() if path.is_symlink() else path
    if (target / EXTRA_DIR / EXPORT_FILE).is_file():
        return verify_export(target, load=load)
    cls = detect_backend(target)
    backend = cls()
    manifest = backend.check_integrity(target, digests=True, strict=True)
    report: dict[str, Any] = {
        "path": str(target),
        "backend": cls.name,
        **_file_counts(manifest),
    }
    if manifest is None:
        record = cls.read_metadata(target).get("integrity")
        if record:
            raise IntegrityError(
                f"{target}: its manifest is missing although the checkpoint was written with "
                f"one ({record}); files may have been removed or replaced. Restore it from a "
                f"copy or load an older checkpoint. Received: no manifest",
                path=target,
                file=str(record),
            )
    if load:
        report.update(_load_checkpoint(backend, target))
    return report


def verify_export(path: Path, *, load: bool = True) -> dict[str, Any]:
    """Verify a serving export version directory (see the module docstring)."""
    manifest = integrity.read_manifest(path, EXPORT_MANIFEST)
    if manifest is None or manifest.get("kind") != "export":
        raise IntegrityError(
            f"{path} is a serving export whose manifest does not cover the whole export (it "
            f"was written by an older trainer, before exports were sealed after their "
            f"metadata and warmup requests), so its files cannot all be checked. Export it "
            f"again from its checkpoint with `python -m trainer export`. Received manifest: "
            f"{'none' if manifest is None else 'kind ' + repr(manifest.get('kind'))}",
            path=path,
            file=EXPORT_MANIFEST,
        )
    integrity.verify_directory(path, EXPORT_MANIFEST, digests=True, strict=True)
    meta = _export_metadata(path)
    report: dict[str, Any] = {
        "path": str(path),
        "backend": "export",
        "kind": "export",
        "exported_with": manifest.get("exported_with"),
        "version": meta.get("version"),
        **_file_counts(manifest),
    }
    if not load:
        return report
    report["warmup_requests"] = _check_warmup(path, meta)
    report["signatures"] = _check_serving(path, meta)
    if manifest.get("exported_with") == "savedmodel":
        cls = detect_backend(path)
        report.update(_load_checkpoint(cls(), path))
    return report


def _file_counts(manifest: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "manifest": manifest is not None,
        "files": len(manifest["files"]) if manifest else None,
        "bytes": sum(f["size"] for f in manifest["files"]) if manifest else None,
    }


def _load_checkpoint(backend: Any, target: Path) -> dict[str, Any]:
    checkpoint = backend.load(target, compile=True)
    return {
        "format_version": checkpoint.metadata.get("format_version"),
        "model": checkpoint.model.name,
        "num_params": int(checkpoint.model.count_params()),
        "global_step": checkpoint.state.global_step,
    }


def _export_metadata(path: Path) -> dict[str, Any]:
    where = path / EXTRA_DIR / EXPORT_FILE
    try:
        meta = json.loads(where.read_text())
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(
            f"{where} matches its manifest but is not readable JSON; the export was written "
            f"damaged. Export it again. Received {type(error).__name__}: {error}"
        ) from None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(
            f"{where} must hold a JSON object; the export was written damaged. Export it "
            f"again. Received {type(meta).__name__}"
        )
    return meta


def _check_warmup(path: Path, meta: dict[str, Any]) -> int:
    """The warmup file must be a readable TFRecord file of the recorded length: TF Serving
    refuses to load a version whose warmup requests it cannot replay."""
    try:
        count = count_warmup(path)
    except tf.errors.OpError as error:
        raise CorruptCheckpointError(
            f"{path}: the warmup requests ({EXTRA_DIR}) cannot be read as TFRecords, so TF "
            f"Serving would refuse the version. Export it again. Received "
            f"{type(error).__name__}: {error.message[:300]}"
        ) from None
    if count != meta.get("warmup_requests", 0):
        raise CorruptCheckpointError(
            f"{path}: {count} warmup request(s) found but the export's metadata records "
            f"{meta.get('warmup_requests')}. Export it again. Received {count}"
        )
    return count


def _check_serving(path: Path, meta: dict[str, Any]) -> list[str]:
    """Load the export as a model server would and answer ``serving_default`` once (on
    zeros; unknown dimensions as 1); returns the signatures it offers."""
    try:
        loaded = tf.saved_model.load(str(path))
        offered = sorted(loaded.signatures)
        missing = sorted(set(meta.get("signatures") or {}) - set(offered))
        if not missing and SERVING_KEY in offered:
            serve = loaded.signatures[SERVING_KEY]
            inputs = {
                name: _blank([d or 1 for d in spec.shape], spec.dtype)
                for name, spec in serve.structured_input_signature[1].items()
            }
            serve(**inputs)
    # AssertionError: what tf.saved_model.load raises for objects its checkpoint leaves
    # unbound (a raw traceback from `trainer verify` before).
    except (tf.errors.OpError, ValueError, TypeError, KeyError, AssertionError) as error:
        raise CorruptCheckpointError(
            f"{path}: its files match the manifest but TensorFlow cannot load or serve it. "
            f"Export it again. Received {type(error).__name__}: {str(error)[:300]}"
        ) from None
    if missing or SERVING_KEY not in offered:
        raise CorruptCheckpointError(
            f"{path} does not offer the signature(s) {missing or [SERVING_KEY]} its metadata "
            f"names. Export it again. Received signatures: {offered}"
        )
    return offered


def _blank(shape: list[int], dtype: tf.DType) -> tf.Tensor:
    if dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, dtype)


def format_report(report: dict[str, Any]) -> str:
    if report["manifest"]:
        files = f"{report['files']} file(s), {report['bytes']:,} bytes match their manifest"
    else:
        files = "no manifest (written before manifests existed): digests not checked"
    if report.get("kind") == "export":
        line = (
            f"OK {report['path']}: serving export version {report['version']} "
            f"({report['exported_with']}), {files}"
        )
        if "signatures" in report:
            line += (
                f"; serves {', '.join(report['signatures'])} with "
                f"{report['warmup_requests']} warmup request(s)"
            )
    else:
        line = f"OK {report['path']}: {report['backend']} checkpoint, {files}"
    if "model" in report:
        line += (
            f"; model {report['model']!r} ({report['num_params']:,} parameters, format "
            f"version {report['format_version']}, step {report['global_step']}) loads"
        )
    return line
