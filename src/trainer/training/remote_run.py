"""A run whose ``run_dir`` is a URL on object storage (``run_dir=s3://bucket/runs/x``), and a
run resuming from a checkpoint on one (``resume=s3://...``, ``resume_dir=s3://...``).

Its checkpoints live on the store (``<run_dir>/<checkpoint.directory>``, published by
their commit markers: ``trainer.storage.remote``), so that a preempted job re-run anywhere
with ``resume=auto`` continues from them. Everything else the run writes goes to a local
mirror directory first, one per URL (``mirror_dir``): the serving export and the
TensorBoard log are then copied to the store (``training.store_sync``); the log, the Hydra
config and the staged checkpoints are not.

``resume`` and ``resume_dir`` may be URLs too, for a run on a store or on disk
(``resume_source``): the checkpoint is downloaded into the local cache (checked against its
commit marker) and the run continues in its own ``run_dir``; the store the checkpoint came
from is only read. Under ``strategy=multiworker`` only the chief
writes to the store (checkpoints, lease, export, TensorBoard log); it alone chooses the
checkpoint to resume from, and every other worker downloads that very checkpoint from the
store into its own cache (``training.chief_decides``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
from pathlib import Path

from omegaconf import DictConfig

from trainer.checkpointing import find_latest
from trainer.errors import ConfigError, CorruptCheckpointError, NotACheckpointError
from trainer.exports.exporter import is_export
from trainer.storage.cache import cache_root
from trainer.storage.locations import is_remote
from trainer.storage.remote import LATEST, RemoteCheckpoints
from trainer.training.chief_decides import chief_decides, everyone_ready
from trainer.training.resume import CHECKPOINT_DIR

log = logging.getLogger(__name__)

RESUMABLE = (None, "auto", "latest")


def is_remote_run(cfg: DictConfig) -> bool:
    return is_remote(cfg.get("run_dir"))


def mirror_dir(url: str) -> Path:
    """The local directory of a run on a store: one per URL, under trainer's cache
    (``TRAINER_STORE_CACHE``'s parent, ``~/.cache/trainer`` by default)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return cache_root().parent / "runs" / digest


def checkpoints_on_store(cfg: DictConfig) -> bool:
    """Whether the run's checkpoints live on a store: its ``run_dir`` is a URL, or its
    ``checkpoint.directory`` is (``checkpoint.directory=s3://...`` with a run on disk: the
    checkpoints alone go to the store, through the same manager, lease and markers)."""
    return is_remote_run(cfg) or is_remote(str(cfg.checkpoint.directory))


def checkpoint_url(cfg: DictConfig) -> str:
    """The URL of the run's checkpoint directory: ``checkpoint.directory`` when it is a
    URL, else that name inside the run's URL."""
    directory = str(cfg.checkpoint.directory)
    if is_remote(directory):
        return directory.rstrip("/")
    return f"{str(cfg.run_dir).rstrip('/')}/{directory.strip('/')}"


def local_checkpoint_name(cfg: DictConfig) -> str:
    """The name of the checkpoint directory inside the run's local directory (its staging
    copy on a store run, a non-chief worker's scratch): ``checkpoint.directory``, or the
    default name when that is a URL (a path must never hold ``s3:``)."""
    directory = str(cfg.checkpoint.directory)
    return CHECKPOINT_DIR if is_remote(directory) else directory


def check(cfg: DictConfig) -> None:
    """Refuse what a run whose checkpoints are on a store does not support yet, before
    anything is written."""
    problems = []
    resume, resume_dir = cfg.get("resume"), cfg.get("resume_dir")
    if resume not in RESUMABLE and not is_remote(resume):
        problems.append((f"resume={resume!r}", "use resume=auto, latest or a checkpoint's URL"))
    if resume_dir and not is_remote(resume_dir):
        problems.append((f"resume_dir={resume_dir!r}", "give a run's URL, or drop it"))
    directory = str(cfg.checkpoint.directory)
    if directory.startswith("/"):
        problems.append((f"checkpoint.directory={directory!r}", "give a relative name or a URL"))
    if problems:
        where = f"run_dir={cfg.run_dir}" if is_remote_run(cfg) else "checkpoint.directory"
        fixes = "; ".join(f"{value} ({fix})" for value, fix in problems)
        raise ConfigError(
            f"{where} is on object storage, so the run resumes from its own checkpoints "
            f"there or from a URL on a store only: fix {fixes}. Received: "
            f"{', '.join(value for value, _ in problems)}, checkpoints in {checkpoint_url(cfg)}"
        )


def locate(
    cfg: DictConfig, dist=None, run_dir: Path | None = None
) -> tuple[Path, Path | None, str | None]:
    """The run's local directory (``run_dir`` for a run on disk whose checkpoints are on a
    store, else the run's mirror), the checkpoint it resumes from (a verified local copy
    of the store's newest complete one) and that checkpoint's URL, or None, None for a
    fresh start. Under ``strategy=multiworker`` (``dist``) the chief chooses and every
    worker gets a copy of the chief's choice (``chief_decides``)."""
    check(cfg)
    remote = RemoteCheckpoints(checkpoint_url(cfg))
    if resumes_from_store(cfg):
        remote, named = resume_source(cfg, own=remote)
        chosen = chief_decides(dist, lambda: choose_in_source(cfg, remote, named))
    else:
        chosen = chief_decides(dist, lambda: choose(cfg, remote))
    if run_dir is None:
        run_dir = mirror_dir(str(cfg.run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
    if chosen is None:
        everyone_ready(dist, None)
        return run_dir, None, None
    failure, path = None, None
    try:  # the chief's copy is in its cache already; another host downloads it now
        path = remote.fetch(chosen)
    except Exception as error:  # any: the other workers must not wait for this one
        failure = error
    everyone_ready(dist, failure)
    return run_dir, path, remote.url_of(chosen)


def choose(cfg: DictConfig, remote: RemoteCheckpoints) -> str | None:
    """The name of the checkpoint the run resumes from (checked whole: downloaded into
    the cache), or None for a fresh start; refuses what a fresh run would overwrite."""
    found = remote.committed()  # raises a StoreError line for a wrong bucket, keys, endpoint
    resume = cfg.get("resume")
    if resume is None:
        if found:
            raise ConfigError(
                f"{remote.url} already holds {len(found)} checkpoint(s) of an earlier run; a "
                f"fresh run there would replace them. Continue that run with resume=auto (or "
                f"resume=latest), or start this one at another URL. "
                f"Received: newest {found[-1]['name']}, resume=null"
            )
        return None
    if not found:
        if resume == "latest":
            raise NotACheckpointError(
                f"resume=latest found no complete checkpoint in {remote.url}. Use resume=auto "
                f"to start afresh when there is none. Received: checkpoint directory "
                f"{remote.url}"
            )
        log.info("resume=auto: no complete checkpoint in %s yet; starting a fresh run", remote.url)
        return None
    return newest_whole(remote, found)


def resumes_from_store(cfg: DictConfig) -> bool:
    """Whether ``resume`` or ``resume_dir`` is a URL: a checkpoint or run on a store."""
    return is_remote(cfg.get("resume")) or is_remote(cfg.get("resume_dir"))


def resume_source(
    cfg: DictConfig, own: RemoteCheckpoints | None = None
) -> tuple[RemoteCheckpoints, str | None]:
    """The checkpoint directory on the store a URL ``resume`` / ``resume_dir`` names, and
    the checkpoint's name in it (None: its newest). ``resume=<URL>``: a checkpoint
    (``<dir>/<name>``, ``<dir>/latest``) or a run (``<run>``, its newest). ``resume_dir=<URL>``
    (with ``resume=auto|latest``): a run or a checkpoint directory, its newest; but once the
    run's own checkpoint directory ``own`` (on a store) holds a checkpoint, that one: the run
    continues in its own ``run_dir``, so re-running the command of a preempted job continues
    its own progress instead of starting again from ``resume_dir``."""
    dirname = local_checkpoint_name(cfg).strip("/")
    resume = cfg.get("resume")
    if is_remote(resume):
        url = str(resume).rstrip("/")
        directory, _, name = url.rpartition("/")
        if not directory.endswith(":/"):  # not s3://bucket alone
            parent = RemoteCheckpoints(directory)
            if name == LATEST or parent.marker(name) is not None:
                return parent, name
        run = RemoteCheckpoints(f"{url}/{dirname}")
        if run.committed():
            return run, None
        raise NotACheckpointError(
            f"resume={url} names no complete checkpoint on the store: neither a checkpoint "
            f"(<dir>/<name> with its commit marker <dir>/.commits/<name>.json, or "
            f"<dir>/latest) nor a run whose {dirname}/ holds one. List them with "
            f"`python -m trainer runs {directory}`. Received: resume={resume!r}"
        )
    if own is not None and own.committed():
        return own, None
    url = str(cfg.get("resume_dir")).rstrip("/")
    run = RemoteCheckpoints(f"{url}/{dirname}")
    return (run if run.committed() else RemoteCheckpoints(url)), None


def choose_in_source(cfg: DictConfig, source: RemoteCheckpoints, named: str | None) -> str | None:
    """The name of the checkpoint of ``source`` the run resumes from (``named``, else the
    newest: ``resume_source``), checked whole (now in the cache); None (a fresh start) for
    ``resume=auto`` and no checkpoint. A serving export is refused: it holds no training
    state to continue."""
    if named is not None:
        name, _marker = source.resolve(named)
    else:
        found = source.committed()
        if not found and cfg.get("resume") == "auto":
            log.info("resume=auto: no complete checkpoint in %s yet; starting afresh", source.url)
            return None
        if not found:
            raise NotACheckpointError(
                f"resume=latest found no complete checkpoint in {source.url}. Use "
                f"resume=auto to start afresh when there is none. Received: "
                f"resume_dir={cfg.get('resume_dir')}"
            )
        name = newest_whole(source, found)
    if is_export(source.fetch(name)):
        raise NotACheckpointError(
            f"{source.url_of(name)} is a serving export, not a training checkpoint: "
            f"training resumes from a run's checkpoints (weights, optimizer, data "
            f"position). Resume from <run URL>/{cfg.checkpoint.directory}/latest instead. "
            f"Received: resume={cfg.get('resume')}"
        )
    return name


def resume_from_store(
    cfg: DictConfig, run_dir: Path, configured: type
) -> tuple[Path | None, str | Path | None]:
    """A run on disk resuming from a URL (``resume=s3://...`` or ``resume_dir=s3://...``):
    a verified local copy of the store's checkpoint; the run continues in ``run_dir``
    (the store is only read). With ``resume_dir`` and ``resume=auto|latest``, once
    ``run_dir`` holds checkpoints of its own the newest of those (read with the run's
    backend class ``configured``) is taken instead, so that re-running a preempted job's
    command continues its own progress. Returns the local checkpoint and where it came
    from (the checkpoint's URL for a copy of the store's, which the session records)."""
    own = run_dir / cfg.checkpoint.directory
    if not is_remote(cfg.get("resume")) and own.is_dir():
        try:
            latest = find_latest(own, configured)
            return latest, latest
        except NotACheckpointError:
            pass  # none yet: the first session starts from the store's
    return fetch_source(cfg)


def fetch_source(
    cfg: DictConfig, own: RemoteCheckpoints | None = None
) -> tuple[Path | None, str | None]:
    """A run on disk resuming from a URL: the local copy of the checkpoint it names and
    its URL (None, None: ``resume=auto`` found none, a fresh start)."""
    source, named = resume_source(cfg, own)
    name = choose_in_source(cfg, source, named)
    return (None, None) if name is None else (source.fetch(name), source.url_of(name))


def newest_whole(remote: RemoteCheckpoints, found: list[dict]) -> str:
    """The name of the newest complete checkpoint whose objects match its marker (now in
    the local cache); a
    damaged newer one is skipped with a warning (as on disk: the run continues from the
    one before, and the manager then sets the damaged one aside). If every one is damaged,
    nothing is chosen: a fresh start would write over them."""
    damaged = []
    for marker in reversed(found):
        log.info("Downloading checkpoint %s", remote.url_of(marker["name"]))
        try:
            remote.fetch(marker["name"])
            return marker["name"]
        except CorruptCheckpointError as error:
            log.warning("Skipping damaged checkpoint %s (%s)", remote.url_of(marker["name"]), error)
            damaged.append(error)
    raise CorruptCheckpointError(
        f"Every checkpoint in {remote.url} is damaged ({len(damaged)}), so there is nothing "
        f"to resume from, and a fresh run would write over them. Restore one from a copy, "
        f"or start at another URL. Received error: {damaged[0]}"
    )


def resume_command(cfg: DictConfig, overrides: list[str], run_dir: Path | None = None) -> str:
    """The command that continues this run from the store (``run_dir``: the run's local
    directory, for a run on disk whose checkpoints are on a store)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("resume", "run_dir")]
    where = cfg.run_dir if is_remote_run(cfg) or run_dir is None else os.fspath(run_dir)
    return shlex.join(["python", "train.py", *kept, f"run_dir={where}", "resume=auto"])
