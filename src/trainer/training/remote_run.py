"""A run whose ``run_dir`` is a URL on object storage (``run_dir=s3://bucket/runs/x``).

Its checkpoints live on the store (``<run_dir>/<checkpoint.directory>``, published by
their commit markers: ``trainer.storage.remote``), so that a preempted job re-run anywhere
with ``resume=auto`` continues from them. Everything else the run writes goes to a local
mirror directory first, one per URL (``mirror_dir``): the serving export and the
TensorBoard log are then copied to the store (``training.store_sync``); the log, the Hydra
config and the staged checkpoints are not.

Kept narrow on purpose: ``resume`` must be ``auto`` or ``latest`` (the run's own
checkpoints) and ``resume_dir`` is not used. Under ``strategy=multiworker`` only the chief
writes to the store (checkpoints, lease, export, TensorBoard log); it alone chooses the
checkpoint to resume from, and every other worker downloads that very checkpoint from the
store into its own cache (``training.chief_decides``).
"""

from __future__ import annotations

import hashlib
import logging
import shlex
from pathlib import Path

from omegaconf import DictConfig

from trainer.errors import ConfigError, CorruptCheckpointError, NotACheckpointError
from trainer.storage.cache import cache_root
from trainer.storage.locations import is_remote
from trainer.storage.remote import RemoteCheckpoints
from trainer.training.chief_decides import chief_decides, everyone_ready

log = logging.getLogger(__name__)

RESUMABLE = (None, "auto", "latest")


def is_remote_run(cfg: DictConfig) -> bool:
    return is_remote(cfg.get("run_dir"))


def mirror_dir(url: str) -> Path:
    """The local directory of a run on a store: one per URL, under trainer's cache
    (``TRAINER_STORE_CACHE``'s parent, ``~/.cache/trainer`` by default)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return cache_root().parent / "runs" / digest


def checkpoint_url(cfg: DictConfig) -> str:
    return f"{str(cfg.run_dir).rstrip('/')}/{str(cfg.checkpoint.directory).strip('/')}"


def check(cfg: DictConfig) -> None:
    """Refuse what a run on a store does not support yet, before anything is written."""
    problems = []
    if cfg.get("resume") not in RESUMABLE:
        problems.append(f"resume={cfg.get('resume')!r} (use resume=auto or resume=latest)")
    if cfg.get("resume_dir"):
        problems.append(f"resume_dir={cfg.get('resume_dir')!r} (drop it: the run is its URL)")
    directory = str(cfg.checkpoint.directory)
    if directory.startswith("/") or is_remote(directory):
        problems.append(f"checkpoint.directory={directory!r} (give a relative name)")
    if problems:
        raise ConfigError(
            f"run_dir={cfg.run_dir} is on object storage, which supports a run "
            f"resumed from its own checkpoints only: fix {'; '.join(problems)}. "
            f"Received: {problems[0]}"
        )


def locate(cfg: DictConfig, dist=None) -> tuple[Path, Path | None]:
    """The local mirror of the run and the checkpoint it resumes from (a verified local
    copy of the store's newest complete one), or None for a fresh start. Under
    ``strategy=multiworker`` (``dist``) the chief chooses and every worker gets a copy of
    the chief's choice (``chief_decides``)."""
    check(cfg)
    remote = RemoteCheckpoints(checkpoint_url(cfg))
    chosen = chief_decides(dist, lambda: choose(cfg, remote))
    mirror = mirror_dir(str(cfg.run_dir))
    mirror.mkdir(parents=True, exist_ok=True)
    if chosen is None:
        everyone_ready(dist, None)
        return mirror, None
    failure, path = None, None
    try:  # the chief's copy is in its cache already; another host downloads it now
        path = remote.fetch(chosen)
    except Exception as error:  # any: the other workers must not wait for this one
        failure = error
    everyone_ready(dist, failure)
    return mirror, path


def choose(cfg: DictConfig, remote: RemoteCheckpoints) -> str | None:
    """The name of the checkpoint the run resumes from (checked whole: downloaded into
    the cache), or None for a fresh start; refuses what a fresh run would overwrite."""
    found = remote.committed()  # raises a StoreError line for a wrong bucket, keys, endpoint
    resume = cfg.get("resume")
    if resume is None:
        if found:
            raise ConfigError(
                f"{cfg.run_dir} already holds {len(found)} checkpoint(s) of an earlier run in "
                f"{remote.url}; a fresh run there would replace them. Continue that run with "
                f"resume=auto (or resume=latest), or start this one at another URL. "
                f"Received: newest {found[-1]['name']}, resume=null"
            )
        return None
    if not found:
        if resume == "latest":
            raise NotACheckpointError(
                f"resume=latest found no complete checkpoint in {remote.url}. Use resume=auto "
                f"to start afresh when there is none. Received: run_dir={cfg.run_dir}"
            )
        log.info("resume=auto: no complete checkpoint in %s yet; starting a fresh run", remote.url)
        return None
    return newest_whole(remote, found)


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


def resume_command(cfg: DictConfig, overrides: list[str]) -> str:
    """The command that continues this run from the store."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("resume", "run_dir")]
    return shlex.join(["python", "train.py", *kept, f"run_dir={cfg.run_dir}", "resume=auto"])
