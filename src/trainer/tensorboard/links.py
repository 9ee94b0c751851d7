"""Reading a run's TensorBoard log back: which steps and tags each event file holds, which
restarts hide which steps, and following an artifact's link to the event file of the run
that produced it.

Split from ``board.py`` (which writes the log) because readers (``trainer inspect``, the
run index, the end of a resumed session) need only this half, and because the two change
for different reasons: what a card holds, versus how TensorBoard reads a directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto import event_pb2

from trainer.errors import TensorBoardLinkError

LINK_KEY = "tensorboard"  # where the link lives in checkpoint / export metadata
_START = event_pb2.SessionLog.START


@dataclasses.dataclass
class ResolvedLink:
    event_file: Path
    log_dir: Path
    run_dir: Path
    run_name: str
    step: int
    tags: list[str]  # every tag the event file holds at that step


def event_steps(event_file: str | os.PathLike) -> dict[int, set[str]]:
    """``{step: {tags}}`` of one event file, streamed without building any index."""
    return _read_events(Path(event_file))[0]


def _read_events(path: Path) -> tuple[dict[int, set[str]], list[int]]:
    """One event file's ``{step: {tags}}`` and the steps of its ``SessionLog.START``s."""
    steps: dict[int, set[str]] = {}
    starts: list[int] = []
    for event in LegacyEventFileLoader(str(path)).Load():
        if event.HasField("summary"):
            tags = steps.setdefault(event.step, set())
            tags.update(value.tag for value in event.summary.value)
        elif event.HasField("graph_def"):
            steps.setdefault(event.step, set()).add("__graph__")
        elif event.HasField("session_log") and event.session_log.status == _START:
            starts.append(event.step)
    return steps, starts


@dataclasses.dataclass
class LogView:
    """What TensorBoard shows of one log directory, each event file read once: the steps
    and tags of every file, and the restarts, each ``SessionLog.START``
    (``callbacks.mark_session_start`` writes one per training session) but the first
    TensorBoard reads, which starts the run and purges nothing. A file that cannot be
    parsed holds nothing here (TensorBoard shows nothing of it either)."""

    steps: dict[str, dict[int, set[str]]]  # event file name -> {step: {tags}}
    restarts: list[tuple[str, int]]  # (event file name, step), in reading order

    @classmethod
    def read(cls, log_dir: str | os.PathLike) -> LogView:
        steps: dict[str, dict[int, set[str]]] = {}
        starts: list[tuple[str, int]] = []
        for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
            try:
                steps[path.name], found = _read_events(path)
            except Exception:  # a damaged file (a killed writer's): it shows nothing
                steps[path.name], found = {}, []
            starts += [(path.name, step) for step in found]
        return cls(steps, starts[1:])

    def tags(self, event_file: Path, step: int) -> set[str]:
        return self.steps.get(event_file.name, {}).get(step, set())

    def hiding_restart(self, event_file: Path, step: int) -> tuple[str, int] | None:
        """The restart that hides ``step`` of ``event_file`` from TensorBoard, or None.
        TensorBoard reads a directory's files in name order and, at each restart, drops
        what it has read at or after the restart's step: an event is hidden by a restart
        in a later file at a step not above its own (the branch a resume abandoned)."""
        for name, restart_step in self.restarts:
            if name > event_file.name and restart_step <= step:
                return name, restart_step
        return None

    def shows(self, event_file: Path, step: int, tag: str | None = None) -> bool:
        """Whether TensorBoard shows ``tag`` (any event, if None) at ``step`` of the file."""
        tags = self.tags(event_file, step)
        hidden = self.hiding_restart(event_file, step) is not None
        return bool(tags) and (tag is None or tag in tags) and not hidden


def link_run_dirs(artifact: Path, link: Mapping[str, Any]) -> list[Path]:
    """Where a link's run directory may be, in order: relative to the artifact's folder (the
    whole run moved), relative to the folder above it (the artifact was set aside one level
    down, into ``checkpoints/abandoned-<n>/``, after its link was written), then the
    absolute path it was written at."""
    candidates = []
    if link.get("run_dir") is not None:
        candidates.append(artifact.parent / link["run_dir"])
        candidates.append(artifact.parent.parent / link["run_dir"])
    if link.get("run_dir_absolute"):
        candidates.append(Path(link["run_dir_absolute"]))
    return candidates


def resolve_link(artifact_path: str | os.PathLike, metadata: Mapping[str, Any]) -> ResolvedLink:
    """Follow the link of the checkpoint/export at ``artifact_path`` to its event file and
    check the file holds the link's step (and its card tag, if it names one).

    ``metadata`` is the artifact's metadata (with a ``"tensorboard"`` entry) or the link.
    """
    link = metadata.get(LINK_KEY, metadata)
    artifact = Path(artifact_path).absolute()
    if not isinstance(link, Mapping) or "event_file" not in link or "step" not in link:
        raise TensorBoardLinkError(
            f"{artifact} carries no TensorBoard link (metadata key {LINK_KEY!r} with "
            f"'event_file' and 'step'); it was saved without a RunBoard. "
            f"Received keys: {sorted(metadata)[:12]}"
        )
    tried = []
    for run_dir in link_run_dirs(artifact, link):
        log_dir = Path(os.path.normpath(run_dir / link.get("log_dir", ".")))
        event_file = log_dir / link["event_file"]
        tried.append(str(event_file))
        if event_file.is_file():
            break
    else:
        raise TensorBoardLinkError(
            f"The TensorBoard event file of {artifact} is gone: none of {tried} exists. The "
            f"run directory was moved without the artifact, or its log was deleted. "
            f"Received link: {dict(link)}"
        )
    step = int(link["step"])
    view = LogView.read(log_dir)
    tags = sorted(view.tags(event_file, step))
    wanted = link.get("tag")
    if not tags or (wanted and wanted not in tags):
        raise TensorBoardLinkError(
            f"{event_file} holds no {'card ' + repr(wanted) if wanted else 'event'} at step "
            f"{step}: the artifact was saved but its card was never written (the run stopped "
            f"in between?). Received tags at that step: {tags}"
        )
    restart = view.hiding_restart(event_file, step)
    if restart is not None:
        raise TensorBoardLinkError(
            f"TensorBoard no longer shows step {step} of {event_file}: a later session of the "
            f"run restarted at step {restart[1]} ({restart[0]}), and TensorBoard drops every "
            f"earlier event at or after a restart's step. {artifact} belongs to the branch "
            f"that a resume from an earlier checkpoint abandoned; its card and curves are "
            f"still in the event file, but TensorBoard hides them. Received link: {dict(link)}"
        )
    return ResolvedLink(
        event_file=event_file,
        log_dir=log_dir,
        run_dir=Path(os.path.normpath(run_dir)),
        run_name=str(link.get("run_name", "")),
        step=step,
        tags=tags,
    )
