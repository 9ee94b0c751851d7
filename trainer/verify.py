"""``python -m trainer verify PATH``: check a checkpoint completely, report the first bad file.

Stronger than ``load``: every file's SHA-256 is compared with the manifest, files added
after the save are reported, and the model is then rebuilt (unless ``--files-only``), so a
checkpoint that verifies is one that loads and holds exactly what was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.errors import IntegrityError
from trainer.save_backends import detect_backend


def verify_checkpoint(path: str | Path, *, load: bool = True) -> dict[str, Any]:
    """Verify ``path``; returns a report, raises a ``TrainerError`` at the first problem."""
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    cls = detect_backend(target)
    backend = cls()
    manifest = backend.check_integrity(target, digests=True, strict=True)
    report: dict[str, Any] = {
        "path": str(target),
        "backend": cls.name,
        "manifest": manifest is not None,
        "files": len(manifest["files"]) if manifest else None,
        "bytes": sum(f["size"] for f in manifest["files"]) if manifest else None,
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
        checkpoint = backend.load(target, compile=True)
        report.update(
            format_version=checkpoint.metadata.get("format_version"),
            model=checkpoint.model.name,
            num_params=int(checkpoint.model.count_params()),
            global_step=checkpoint.state.global_step,
        )
    return report


def format_report(report: dict[str, Any]) -> str:
    if report["manifest"]:
        files = f"{report['files']} file(s), {report['bytes']:,} bytes match their manifest"
    else:
        files = "no manifest (written before manifests existed): digests not checked"
    line = f"OK {report['path']}: {report['backend']} checkpoint, {files}"
    if "model" in report:
        line += (
            f"; model {report['model']!r} ({report['num_params']:,} parameters, format "
            f"version {report['format_version']}, step {report['global_step']}) loads"
        )
    return line
