"""The runs under an object-storage prefix (``trainer runs s3://bucket/runs``), found
through their commit markers only.

On a store a checkpoint or export version exists only once its commit marker
``<dir>/.commits/<name>.json`` is written (``trainer.storage.remote``): objects without one
(an upload or a delete cut short) are never listed, and markers set aside by a resume
(``<dir>/abandoned-<n>/.commits/``) are not either. Nothing is downloaded but the markers
and each directory's ``latest``: a marker holds the step, epoch, time and every object's
size, which is what a listing shows. A directory whose markers are all numbered is a
run's serving export (``export/<version>``); any other is its checkpoint directory. The run
is the directory above either.
"""

from __future__ import annotations

import datetime
from typing import Any

from trainer.checkpointing.set_aside import ABANDONED
from trainer.storage.remote import COMMITS, RemoteCheckpoints
from trainer.storage.store import Store


def list_store_runs(url: str) -> dict[str, Any]:
    """Every run under ``url`` (or ``url`` itself, a run): its checkpoints and export
    versions, from their commit markers. Raises ``StoreError`` for a missing bucket,
    refused credentials or an unreachable endpoint."""
    store = Store(url)
    store.check_bucket()
    directories = sorted(
        {
            key.rsplit(f"/{COMMITS}/", 1)[0] if f"/{COMMITS}/" in key else ""
            for key in store.walk("")
            if _is_marker(key)
        }
    )
    runs: dict[str, dict[str, Any]] = {}
    for directory in directories:
        remote = RemoteCheckpoints(store.url_of(directory))
        markers = remote.committed()
        if not markers:  # deleted since the listing
            continue
        export = all(m["name"].isdigit() for m in markers)
        run, _, _ = directory.rpartition("/")
        entry = runs.setdefault(
            run,
            {"run_dir": store.url_of(run), "name": run or ".", "checkpoints": [], "exports": []},
        )
        latest = remote.read_latest()
        kind = "export" if export else "checkpoint"
        entry["exports" if export else "checkpoints"] += [
            _describe(remote, marker, kind, latest) for marker in markers
        ]
    return {"output_dir": store.url, "runs": [runs[name] for name in sorted(runs)]}


def _is_marker(key: str) -> bool:
    """``<dir>/.commits/<name>.json`` (or ``.commits/<name>.json`` at the prefix itself),
    outside any folder a resume set aside."""
    parts = key.split("/")
    return (
        len(parts) >= 2
        and parts[-2] == COMMITS
        and parts[-1].endswith(".json")
        and not any(p.startswith(ABANDONED) for p in parts[:-2])
    )


def _describe(
    remote: RemoteCheckpoints, marker: dict[str, Any], kind: str, latest: str | None
) -> dict[str, Any]:
    written = marker.get("written")
    return {
        "kind": kind,
        "name": marker["name"],
        "url": remote.url_of(marker["name"]),
        "step": marker["step"],
        "epoch": marker.get("epoch"),
        "files": len(marker["objects"]),
        "bytes": sum(e["size"] for e in marker["objects"]),
        "written": (
            datetime.datetime.fromtimestamp(written, datetime.UTC).isoformat(timespec="seconds")
            if isinstance(written, int | float)
            else None
        ),
        "latest": marker["name"] == latest,
    }


def format_store_runs(listing: dict[str, Any]) -> str:
    lines = [f"{len(listing['runs'])} run(s) under {listing['output_dir']} (commit markers)"]
    for run in listing["runs"]:
        lines.append(f"\nrun {run['name']}  ({run['run_dir']})")
        artifacts = run["checkpoints"] + run["exports"]
        if not artifacts:
            lines.append("  no checkpoints or exports")
        for item in artifacts:
            epoch = "-" if item["epoch"] is None else item["epoch"]
            lines.append(
                f"  {item['kind']:<10} {item['name']:<24} epoch {epoch} step {item['step']}  "
                f"{item['files']} file(s), {item['bytes']} bytes  written {item['written']}"
                f"{'  (latest)' if item['latest'] else ''}"
            )
    return "\n".join(lines)
