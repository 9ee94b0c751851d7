"""Where a path may point: this machine's filesystem only, for now.

A URL such as ``s3://bucket/runs/x`` is a valid relative path to the operating system
(a folder ``s3:`` in the working directory), so before this check a run configured for
object storage trained "successfully" into a local folder and a load read it back from
there: the user believed the checkpoints were on the store. Every place a user names a
checkpoint, run, export or log location passes it through :func:`local_path`, which
refuses any URL scheme but ``file://`` with a clear error. Object storage (issue 40) will
replace the refusal with a real store behind the same function.
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
        f"The {what} is a {scheme}:// URL, but trainer reads and writes this machine's "
        f"filesystem only (object storage is not supported yet). A URL would otherwise be "
        f"taken for a local folder named {scheme + ':'!r}. Use a local path, or a mounted "
        f"bucket's local path. Received: {value!r}"
    )
