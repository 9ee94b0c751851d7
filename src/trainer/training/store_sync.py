"""What a run copies to object storage besides its checkpoints: the serving export and
the TensorBoard log, written locally first (in the run directory, or in the local mirror
``remote_run.mirror_dir`` of a run on a store). They go to the store when the run is on
one (``run_dir=s3://...``: ``<run_dir>/<export.directory>``, ``<run_dir>/<tensorboard_dir>``)
or when ``export.directory`` / ``trainer.tensorboard_dir`` is a URL itself, for a run on
disk or on a store (then written locally under ``export`` / ``tb`` first:
``export_location``, ``tensorboard_location``).

- The export: once a version is complete locally (written under a temporary name,
  manifest sealed, renamed), it is uploaded object by object to
  ``<export URL>/<version>/`` and published as checkpoints are
  (``trainer.storage.remote``): its commit marker ``<export dir>/.commits/<version>.json``
  is written last, ``saved_model.pb`` is the last object before it (a model server
  polling the prefix finds no loadable SavedModel before every other file is there), and
  ``<export dir>/latest`` names it. A resumed run on another machine numbers its local
  versions from 1 again: a version the store already holds is published under the next
  free number instead, so a server never sees a version replaced or going backwards.
  Versions beyond ``export.keep`` are deleted from the store, marker first.
- The TensorBoard log: every file under the local log directory is uploaded to the same
  relative path under the log's URL after each checkpoint write and at the end of the
  session (normal end, signal or error). Event files only grow, so uploading a whole
  file again is correct; an unchanged one (same size and modification time) is skipped.
  A resumed session on another machine starts from an empty mirror and writes new event
  files beside the earlier session's on the store (TensorBoard reads every event file of
  a directory); their names carry the creation second, host and process id
  (``events.out.tfevents.<time>.<host>.<pid>.<n>``), so they do not collide.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from omegaconf import DictConfig

from trainer.storage.locations import is_remote
from trainer.storage.remote import RemoteCheckpoints
from trainer.storage.store import Store
from trainer.training.remote_run import is_remote_run

log = logging.getLogger(__name__)

# A SavedModel's graph: uploaded last, so that a server never loads a partial version.
LAST = ("saved_model.pb",)


# The local names of an export or log whose configured location is a URL.
LOCAL_EXPORT = "export"
LOCAL_TENSORBOARD = "tb"


def export_location(cfg: DictConfig) -> tuple[str, str | None]:
    """The export's directory under the run's local directory, and its URL on a store (or
    None: a run on disk exporting to disk)."""
    options = cfg.get("export") or {}
    return _location(cfg, str(options.get("directory") or LOCAL_EXPORT), LOCAL_EXPORT)


def tensorboard_location(cfg: DictConfig) -> tuple[str, str | None]:
    """The TensorBoard log's directory under the run's local directory, and its URL on a
    store (or None)."""
    return _location(cfg, str(cfg.trainer.tensorboard_dir), LOCAL_TENSORBOARD)


def _location(cfg: DictConfig, configured: str, local: str) -> tuple[str, str | None]:
    if is_remote(configured):
        return local, configured.rstrip("/")
    if is_remote_run(cfg):
        return configured, f"{str(cfg.run_dir).rstrip('/')}/{configured.strip('/')}"
    return configured, None


def export_options(cfg: DictConfig) -> dict:
    """The ``export`` options with the local directory the export is written into."""
    options = dict(cfg.get("export") or {})
    options["directory"] = export_location(cfg)[0]
    return options


def check_buckets(cfg: DictConfig) -> None:
    """Refuse a missing bucket (wrong keys, an unreachable endpoint) of a URL
    ``export.directory`` or ``trainer.tensorboard_dir`` before training, not at its end
    (``StoreError``)."""
    for url in (export_location(cfg)[1], tensorboard_location(cfg)[1]):
        if url is not None:
            Store(url).check_bucket()


def publish_export(
    export_url: str,
    version_dir: Path,
    *,
    step: int,
    keep: int,
    unless_step_there: bool = False,
) -> str | None:
    """Upload the complete local export ``version_dir`` (``.../export/<n>``) to
    ``export_url`` and publish it; delete store versions beyond ``keep``.
    Returns the published version's URL, or None when ``unless_step_there`` and the store
    already has a version of ``step``. Raises ``StoreError`` if an upload fails (the
    version is then not published: it has no marker)."""
    remote = RemoteCheckpoints(export_url)
    found = [m for m in remote.committed() if m["name"].isdigit()]
    if unless_step_there and any(m["step"] == step for m in found):
        return None
    taken = sorted(int(m["name"]) for m in found)
    version = int(version_dir.name)
    if taken and version <= taken[-1]:
        version = taken[-1] + 1
        log.info(
            "The store already holds export version %d (an earlier session's); publishing "
            "local version %s as version %d",
            taken[-1],
            version_dir.name,
            version,
        )
    remote.publish(version_dir, step=step, name=str(version), last=LAST)
    remote.point_latest(str(version))
    for old in [*taken, version][: -max(int(keep), 1)]:
        remote.delete(str(old))
    return remote.url_of(str(version))


class EventSync:
    """Uploads the run's local TensorBoard directory ``root`` to ``url``, file by file,
    skipping files unchanged since their last upload. Safe to call from the checkpoint
    writer thread and the training thread (one upload at a time)."""

    def __init__(self, url: str, root: Path):
        self.store = Store(url)
        self.root = Path(root)
        self.url = self.store.url
        self._sent: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def __call__(self) -> int:
        """Upload every new or grown file; returns how many were uploaded. Hidden files
        (an hparams rewrite's temporary) are skipped."""
        with self._lock:
            count = 0
            for path in sorted(self.root.rglob("*")) if self.root.is_dir() else []:
                relative = path.relative_to(self.root)
                if not path.is_file() or any(p.startswith(".") for p in relative.parts):
                    continue
                stat = path.stat()
                seen = (stat.st_size, stat.st_mtime_ns)
                key = relative.as_posix()
                if self._sent.get(key) == seen:
                    continue
                self.store.put_file(path, key)
                self._sent[key] = seen
                count += 1
            return count

    def final(self, *, failing: bool) -> None:
        """The end-of-session upload. While another error is propagating (``failing``), a
        failed upload is logged, not raised: the first error is the one to see."""
        try:
            uploaded = self()
        except Exception:
            if not failing:
                raise
            log.exception("Could not upload the TensorBoard log to %s", self.url)
            return
        log.info("TensorBoard log on the store: %s (%d file(s) uploaded)", self.url, uploaded)
