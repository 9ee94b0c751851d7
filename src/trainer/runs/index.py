"""Every run under a Hydra outputs directory, with its checkpoints, exports and TB run.

Built for ``python -m trainer runs``: it reads metadata only (a JSON file or one HDF5
dataset per artifact), never a model, except for a checkpoint of an unknown backend that
offers no cheap reader, which is loaded (and reported as such).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.errors import NotACheckpointError, TrainerError
from trainer.exports.exporter import is_export, read_export_metadata, versions
from trainer.save_backends import SaveBackend
from trainer.storage.atomic import is_temporary
from trainer.storage.locations import is_remote
from trainer.tensorboard.board import LINK_KEY
from trainer.tensorboard.links import LogView, link_run_dirs

# Where a run keeps what, by config key; the first key present wins, then the default.
DIR_KEYS = {
    "checkpoints": (("checkpoint", "directory"), ("trainer", "checkpoint_dir")),
    "export": (("export", "directory"), ("export", "dir"), ("trainer", "export_dir")),
    "tensorboard": (("trainer", "tensorboard_dir"), ("tensorboard", "directory")),
}
DEFAULT_DIRS = {"checkpoints": "checkpoints", "export": "export", "tensorboard": "tb"}
# Written by trainer.runs.sessions: a copy of each session's Hydra config inside the run, and a
# marker in the Hydra output directory of a session that continued another run.
SESSIONS_DIR = ".hydra/sessions"
SESSION_MARKER = ".hydra/session_of.yaml"


def read_metadata(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """``(metadata, how)`` of a checkpoint or export; ``how`` is ``"metadata"`` when only
    metadata was read, ``"loaded model"`` when the checkpoint had to be loaded."""
    from trainer.save_backends import detect_backend

    path = Path(path)
    if is_export(path):
        return read_export_metadata(path), "metadata"
    cls = detect_backend(path)
    if cls.read_metadata.__func__ is not SaveBackend.read_metadata.__func__:
        try:
            return cls.read_metadata(path), "metadata"
        except (OSError, ValueError, KeyError, TrainerError):
            pass  # fall back to a full load, which reports damage properly
    return cls().load(path, compile=False).metadata, "loaded model"


class _StepCache:
    """What TensorBoard shows of each log directory (``LogView``), read at most once per
    listing."""

    def __init__(self):
        self._views: dict[Path, LogView] = {}

    def holds(self, event_file: Path, step: int, tag: str | None) -> bool:
        """Whether TensorBoard shows ``tag`` (any event, if None) at ``step`` of the file:
        written there, and not hidden by a later session's restart (``resolve_link``)."""
        if event_file.parent not in self._views:
            self._views[event_file.parent] = LogView.read(event_file.parent)
        return self._views[event_file.parent].shows(event_file, step, tag)


def describe_artifact(
    path: Path, kind: str, output_dir: Path, cache: _StepCache | None = None
) -> dict[str, Any]:
    """One checkpoint or export as a JSON-able dict (``error`` set if unreadable)."""
    entry: dict[str, Any] = {"kind": kind, "name": path.name, "path": str(path)}
    try:
        meta, how = read_metadata(path)
    except TrainerError as error:
        entry["error"] = str(error).splitlines()[0]
        return entry
    state = meta.get("state") or {}
    source = meta.get("source") or {}
    entry.update(
        {
            "backend": meta.get("exported_with") or meta.get("backend"),
            "format_version": meta.get("format_version"),
            "epoch": state.get("epoch"),
            "step": state.get("global_step"),
            "metrics": state.get("metrics") or {},
            "read": how,
        }
    )
    if kind == "export":
        entry["version"] = meta.get("version")
        entry["source_checkpoint"] = source.get("checkpoint")
    link = meta.get(LINK_KEY)
    if isinstance(link, dict):
        entry["tensorboard"] = _link_summary(path, link, output_dir, cache or _StepCache())
    return entry


def _link_summary(
    path: Path, link: dict[str, Any], output_dir: Path, cache: _StepCache
) -> dict[str, Any]:
    summary = {"run_name": link.get("run_name"), "step": link.get("step")}
    for run_dir in link_run_dirs(path.absolute(), link):
        log_dir = Path(os.path.normpath(run_dir / link.get("log_dir", "")))
        event_file = log_dir / str(link.get("event_file"))
        if event_file.is_file():
            summary["run"] = _relative_or_absolute(log_dir, output_dir)
            summary["event_file"] = str(event_file)
            summary["resolves"] = cache.holds(event_file, int(link["step"]), link.get("tag"))
            return summary
    summary["resolves"] = False
    return summary


def _relative_or_absolute(path: Path, base: Path) -> str:
    try:
        return path.absolute().relative_to(base.absolute()).as_posix()
    except ValueError:
        return str(path)


def run_dirs(output_dir: Path) -> list[Path]:
    """Run directories under ``output_dir`` (itself included): those holding a Hydra
    ``.hydra/config.yaml``, or a checkpoint, export or TensorBoard directory."""
    found = set()
    for hydra_config in output_dir.rglob(".hydra/config.yaml"):
        found.add(hydra_config.parent.parent)
    for name in set(DEFAULT_DIRS.values()):
        for sub in [output_dir / name, *output_dir.rglob(f"*/{name}")]:
            if sub.is_dir() and not any(p.name == ".hydra" for p in sub.parents):
                found.add(sub.parent)
    # A run inside another run's artifacts (export of export) is not a run of its own; nor
    # is the Hydra output directory of a session that resumed another run.
    runs = sorted(r for r in found if session_of(r) is None)
    return [r for r in runs if not any(o != r and o in r.parents for o in runs)]


def session_of(directory: Path) -> dict[str, Any] | None:
    """The marker of a Hydra output directory that only holds a session of another run
    (its config and log; everything else went to the run), else None."""
    marker = directory / SESSION_MARKER
    if not marker.is_file() or any((directory / d).is_dir() for d in DEFAULT_DIRS.values()):
        return None
    loaded = _load_yaml(marker)
    return loaded if isinstance(loaded, dict) and loaded.get("run_dir") else None


def session_dirs(output_dir: Path) -> list[dict[str, Any]]:
    """Every session output directory under ``output_dir``, with the run it belongs to."""
    found = []
    for marker in sorted(output_dir.rglob(SESSION_MARKER)):
        directory = marker.parent.parent
        info = session_of(directory)
        if info is not None:
            found.append({"dir": str(directory), **info})
    return found


def sessions(run_dir: Path) -> list[dict[str, Any]]:
    """The run's sessions recorded by trainer.runs.sessions, oldest first."""
    root = run_dir / SESSIONS_DIR
    numbered = sorted((int(p.name), p) for p in root.glob("*") if p.name.isdigit())
    out = []
    for _, path in numbered:
        info = _load_yaml(path / "session.yaml")
        out.append(info if isinstance(info, dict) else {"session": int(path.name)})
    return out


def _load_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None  # a damaged record must not hide the run


def run_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):
        return None  # a damaged config must not hide the run's artifacts


def subdir(run_dir: Path, config: dict[str, Any] | None, what: str) -> Path:
    for keys in DIR_KEYS[what]:
        node: Any = config or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, str) and node:
            # A URL (export.directory=s3://...): the run's local copy has the default name.
            return run_dir / (DEFAULT_DIRS[what] if is_remote(node) else node)
    return run_dir / DEFAULT_DIRS[what]


def store_url(config: dict[str, Any] | None, what: str) -> str | None:
    """The URL the run's config gives for ``what`` (``checkpoint.directory=s3://...``), or
    None: its local directory is then the only one."""
    for keys in DIR_KEYS[what]:
        node: Any = config or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, str) and node:
            return node if is_remote(node) else None
    return None


def describe_run(run_dir: Path, output_dir: Path) -> dict[str, Any]:
    config = run_config(run_dir)
    cache = _StepCache()
    checkpoint_dir = subdir(run_dir, config, "checkpoints")
    export_dir = subdir(run_dir, config, "export")
    log_dir = subdir(run_dir, config, "tensorboard")
    checkpoints = []
    if checkpoint_dir.is_dir():
        for child in sorted(checkpoint_dir.iterdir()):
            if is_temporary(child) or child.is_symlink() or child.name.startswith("."):
                continue  # temporaries of a writer, and the ``latest`` pointer
            checkpoints.append(describe_artifact(child, "checkpoint", output_dir, cache))
    exports = [
        describe_artifact(export_dir / str(v), "export", output_dir, cache)
        for v in versions(export_dir)
    ]
    checkpoints.sort(key=lambda c: (c.get("step") is None, c.get("step") or 0, c["name"]))
    events = sorted(log_dir.glob("*tfevents*")) if log_dir.is_dir() else []
    return {
        "run_dir": str(run_dir),
        "name": _relative_or_absolute(run_dir, output_dir),
        "has_hydra_config": config is not None,
        "tensorboard": {
            "log_dir": str(log_dir) if log_dir.is_dir() else None,
            "run": _relative_or_absolute(log_dir, output_dir) if events else None,
            "event_files": [e.name for e in events],
        },
        "checkpoints": checkpoints,
        # checkpoint.directory=s3://...: listed by `trainer runs <URL>` (commit markers).
        "checkpoints_url": store_url(config, "checkpoints"),
        "exports": exports,
        "sessions": sessions(run_dir),
    }


def list_runs(output_dir: str | os.PathLike) -> dict[str, Any]:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise NotACheckpointError(
            f"{output_dir} is not a directory. Pass a Hydra outputs directory (outputs/ or "
            f"multirun/) or a run directory. Received: {str(output_dir)!r}"
        )
    runs = [describe_run(r, output_dir) for r in run_dirs(output_dir)]
    return {
        "output_dir": str(output_dir),
        "tensorboard_command": f"tensorboard --logdir {output_dir}",
        "runs": runs,
        "session_dirs": session_dirs(output_dir),
    }


def format_runs(listing: dict[str, Any]) -> str:
    lines = [f"{len(listing['runs'])} run(s) under {listing['output_dir']}"]
    for run in listing["runs"]:
        tb = run["tensorboard"]["run"] or "no TensorBoard log"
        name = run["name"] if run["name"] != "." else f"{Path(run['run_dir']).name} (.)"
        lines.append(f"\nrun {name}  (TensorBoard run: {tb})")
        if len(run.get("sessions") or []) > 1:
            lines.append(f"  {len(run['sessions'])} sessions (see .hydra/sessions/)")
        for session in run.get("sessions") or []:
            if is_remote(session.get("resumed_from")):  # a checkpoint on a store
                lines.append(
                    f"  session {session.get('session')} resumed from {session['resumed_from']}"
                )
        if run.get("checkpoints_url"):
            url = run["checkpoints_url"]
            lines.append(f"  checkpoints on the store: {url} (list them: trainer runs {url})")
        artifacts = run["checkpoints"] + run["exports"]
        if not artifacts and not run.get("checkpoints_url"):
            lines.append("  no checkpoints or exports")
        for item in artifacts:
            lines.append("  " + _format_artifact(item))
    for entry in listing.get("session_dirs") or []:
        where = _relative_or_absolute(Path(entry["dir"]), Path(listing["output_dir"]))
        lines.append(
            f"\nsession {where}: session {entry.get('session', '?')} of run {entry['run_dir']} "
            f"(its config and log; the rest is in the run)"
        )
    lines.append(f"\nOpen the curves with: {listing['tensorboard_command']}")
    return "\n".join(lines)


def _format_artifact(item: dict[str, Any]) -> str:
    head = f"{item['kind']:<10} {item['name']:<24}"
    if "error" in item:
        return f"{head} unreadable: {item['error']}"
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(item["metrics"].items())) or "-"
    text = (
        f"{head} epoch {item['epoch']} step {item['step']}  {item['backend']} "
        f"v{item['format_version']}  {metrics}"
    )
    link = item.get("tensorboard")
    if link:
        where = link.get("run") or link.get("run_name")
        text += f"  [tb {where} @ step {link['step']}{'' if link['resolves'] else ' BROKEN'}]"
    if item.get("read") == "loaded model":
        text += "  (model loaded to read metadata)"
    return text
