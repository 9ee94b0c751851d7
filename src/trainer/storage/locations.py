"""Where a path may point: this machine's filesystem, or object storage where supported.

A URL such as ``s3://bucket/runs/x`` is a valid relative path to the operating system
(a folder ``s3:`` in the working directory), so before this check a run configured for
object storage trained "successfully" into a local folder and a load read it back from
there: the user believed the checkpoints were on the store. Every place a user names a
checkpoint, run, export or log location passes it through :func:`local_path`, which
refuses any URL scheme but ``file://`` with a clear error. The places that do keep data on
object storage (checkpoint directories, ``load_checkpoint``, train.py's run directory,
checkpoint directory, resume source, export directory and TensorBoard directory: issue 40)
ask :func:`is_remote` first and hand the URL to ``trainer.storage.remote``; every other
location (a checkpoint path given to a backend, ``export_serving``'s directory, the CLI's
export output) still refuses it here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trainer.errors import UnsupportedLocationError

# RFC 3986 scheme, then "://". A Windows drive ("C:\\x") has no "//" and stays a path.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def url_scheme(value: str | os.PathLike) -> str | None:
    """The URL scheme of ``value`` (``"s3"``), or None for a plain path."""
    match = _URL.match(os.fspath(value)) if isinstance(value, str) else None
    return match.group(1).lower() if match else None


# URL schemes served by trainer.storage.store (a URL of another scheme is still refused).
REMOTE_SCHEMES = ("s3", "gs")


def is_remote(value: object) -> bool:
    """Whether ``value`` is a URL of object storage (``s3://...``); a ``file://`` URL or a
    path is not. An unknown scheme is remote too, so that it reaches the store's clear
    refusal instead of becoming a local folder."""
    scheme = url_scheme(value) if isinstance(value, str | os.PathLike) else None
    return scheme is not None and scheme != "file"


def local_path(value: str | os.PathLike, what: str = "path") -> Path:
    """``value`` as a local ``Path``; ``file://`` URLs become their path.

    Raises:
        UnsupportedLocationError: ``value`` is a URL of another scheme (``s3://``,
            ``gs://``, ``hdfs://``...): trainer reads and writes local paths only.
    """
    if isinstance(value, Path):
        return value
    scheme = url_scheme(value)
    if scheme is None:
        return Path(value)
    if scheme == "file":
        parts = urlsplit(os.fspath(value))
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedLocationError(
                f"The {what} is a file:// URL on another host ({parts.netloc!r}); only "
                f"this machine's files can be used. Give a local path. Received: {value!r}"
            )
        return Path(unquote(parts.path))
    raise UnsupportedLocationError(
        f"The {what} is a {scheme}:// URL, but trainer reads and writes it on this machine's "
        f"filesystem only (object storage serves checkpoint directories, load_checkpoint, "
        f"and train.py's run_dir, checkpoint.directory, resume, resume_dir, export.directory "
        f"and trainer.tensorboard_dir, through s3:// and gs:// URLs). A URL would otherwise be "
        f"taken for a local folder named {scheme + ':'!r}. Use a local path. Received: {value!r}"
    )
