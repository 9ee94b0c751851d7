"""The sessions of one run: each start or resume of ``python train.py`` on a run directory.

Why: Hydra gives every invocation its own output directory (``outputs/<date>/<time>/``) for
its ``.hydra/`` config and ``train.log``. A resumed session continues in the run directory
that wrote the checkpoint, so without this its log and config stayed in a directory of
their own: the run's ``train.log`` stopped after the first session and ``runs`` listed each
resume as an empty run. Here every session under Hydra

* keeps a copy of Hydra's config files in ``<run>/.hydra/sessions/<n>/`` (``config.yaml``,
  ``overrides.yaml``, ``hydra.yaml`` and ``session.yaml``: where its Hydra outputs went and
  what it resumed from), so the run holds the history of every session's config;
* when its Hydra output directory is another directory, appends its log to the run's own
  log file (the same name and format as Hydra's file handler) for the session, and marks
  that output directory as a session of the run (``.hydra/session_of.yaml``), which
  ``python -m trainer runs`` lists under the run instead of as a run of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import yaml
from hydra.core.hydra_config import HydraConfig

from trainer.runs.index import SESSION_MARKER, SESSIONS_DIR
from trainer.storage.atomic import temporary_sibling

log = logging.getLogger(__name__)

HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")


@contextlib.contextmanager
def session(run_dir: Path, resumed_from: Path | None) -> Iterator[None]:
    """While active, this session is recorded in ``run_dir`` and logs into its log file."""
    output_dir = hydra_output_dir()
    if output_dir is None:  # train(cfg) outside Hydra: no session files to keep
        yield
        return
    elsewhere = output_dir.resolve() != Path(run_dir).resolve()
    handlers = mirror_file_logs(output_dir, run_dir) if elsewhere else []
    try:
        number = record(run_dir, output_dir, resumed_from)
        if elsewhere:
            mark_session_of(output_dir, run_dir, number)
            log.info(
                "Session %d of run %s (Hydra's outputs of this session: %s)",
                number,
                run_dir,
                output_dir,
            )
    except OSError as error:  # bookkeeping: it must not stop the training it describes
        log.warning("Could not record this session in %s: %s", run_dir, error)
    try:
        yield
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()


def hydra_output_dir() -> Path | None:
    if not HydraConfig.initialized():
        return None
    return Path(HydraConfig.get().runtime.output_dir)


def hydra_files_dir(output_dir: Path) -> Path | None:
    subdir = HydraConfig.get().output_subdir if HydraConfig.initialized() else None
    return output_dir / subdir if subdir else None


def record(run_dir: Path, output_dir: Path, resumed_from: Path | None) -> int:
    """Copy this session's Hydra config files into the next ``sessions/<n>/``; return n."""
    root = Path(run_dir) / SESSIONS_DIR
    root.mkdir(parents=True, exist_ok=True)
    number = 1 + max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0)
    target = root / str(number)
    tmp = temporary_sibling(target)
    tmp.mkdir()
    source = hydra_files_dir(output_dir)
    for name in HYDRA_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    info = {
        "session": number,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "hydra_output_dir": os.fspath(output_dir.absolute()),
        "resumed_from": os.fspath(resumed_from) if resumed_from is not None else None,
    }
    (tmp / "session.yaml").write_text(yaml.safe_dump(info, sort_keys=False))
    os.replace(tmp, target)
    return number


def mark_session_of(output_dir: Path, run_dir: Path, number: int) -> None:
    """Mark Hydra's output directory of this session as a session of ``run_dir``."""
    if hydra_files_dir(output_dir) is None:
        return  # no .hydra/ there: nothing makes it look like a run
    marker = output_dir / SESSION_MARKER
    marker.parent.mkdir(parents=True, exist_ok=True)
    record = {"run_dir": os.fspath(Path(run_dir).absolute()), "session": number}
    marker.write_text(yaml.safe_dump(record))


def mirror_file_logs(output_dir: Path, run_dir: Path) -> list[logging.Handler]:
    """For each root file handler writing into ``output_dir`` (Hydra's ``train.log``), one
    appending to the same file name in ``run_dir``, same format and level; not where that
    name is a symbolic link (a run directory may come from elsewhere: appending would
    write to whatever file the link names)."""
    added: list[logging.Handler] = []
    root = logging.getLogger()
    for handler in list(root.handlers):
        if not isinstance(handler, logging.FileHandler):
            continue
        path = Path(handler.baseFilename)
        if path.parent.resolve() != output_dir.resolve():
            continue
        target = Path(run_dir) / path.name
        if target.is_symlink():  # a run's log is its own file; never append through a link
            log.warning("Not mirroring the log into %s: it is a symbolic link", target)
            continue
        mirror = logging.FileHandler(target, mode="a", encoding=handler.encoding)
        mirror.setFormatter(handler.formatter)
        mirror.setLevel(handler.level)
        root.addHandler(mirror)
        added.append(mirror)
    return added


def restore_hydra_files(run_dir: Path) -> list[Path]:
    """Put back the run's own Hydra config files after a second process, refused because
    the run is in use (``DirectoryInUseError``), was given the same output directory:
    Hydra rewrote ``.hydra/config.yaml`` (and the others) before trainer could refuse, and
    the run then described another config (``trainer runs`` read its checkpoint directory
    from it). The copy is the newest session's whose Hydra outputs went to ``run_dir``.
    Returns the files restored."""
    output_dir = hydra_output_dir()
    if output_dir is None or output_dir.resolve() != Path(run_dir).resolve():
        return []
    target = hydra_files_dir(output_dir)
    source = _newest_session_written_to(Path(run_dir))
    if target is None or source is None:
        return []
    restored = []
    for name in HYDRA_FILES:
        if (source / name).is_file():
            tmp = temporary_sibling(target / name)
            shutil.copy2(source / name, tmp)
            os.replace(tmp, target / name)
            restored.append(target / name)
    return restored


def _newest_session_written_to(run_dir: Path) -> Path | None:
    root = run_dir / SESSIONS_DIR
    numbered = sorted((p for p in root.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    for session_dir in reversed(numbered):
        try:
            info = yaml.safe_load((session_dir / "session.yaml").read_text()) or {}
            written_to = Path(str(info.get("hydra_output_dir")))
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if written_to.resolve() == run_dir.resolve():
            return session_dir
    return None
