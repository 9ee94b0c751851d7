"""What ``gs://`` URLs need beyond what fsspec gives every scheme: the filesystem's options,
the version an object's conditional replace is checked against, and that replace itself.

Google Cloud Storage has no ETags to compare and no ``If-None-Match``; it numbers every
version of an object (its *generation*) and takes a precondition on it: a write with
``ifGenerationMatch=0`` succeeds only if no object has the name (the lease's conditional
create, which gcsfs sends for ``pipe_file(mode="create")``), and one with
``ifGenerationMatch=<n>`` only if the object is still version ``n`` (the lease's
compare-and-swap). gcsfs has no argument for the second, so it goes through Google's own
client library (``google-cloud-storage``, which gcsfs itself depends on), whose public
``upload_from_string(if_generation_match=...)`` sends it. Everything else (reads, uploads,
listings, deletes) stays on gcsfs, as ``s3://`` stays on s3fs.

Configuration is what other GCS tools read: Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, a
machine's service account) and, for an emulator, ``STORAGE_EMULATOR_HOST``, where, as with
Google's own clients, requests are sent without credentials.
"""

from __future__ import annotations

import os
from typing import Any

EMULATOR = "STORAGE_EMULATOR_HOST"
# Settings a filesystem or client is created from (see trainer.storage.store._SETTINGS).
SETTINGS = (EMULATOR, "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")
_clients: dict[tuple, Any] = {}


def options() -> dict[str, Any]:
    """gcsfs's options for the current environment: anonymous requests to an emulator
    (which checks no credentials), the default credential chain otherwise."""
    return {"token": "anon"} if os.environ.get(EMULATOR) else {}


def endpoint() -> str:
    host = os.environ.get(EMULATOR)
    return f"endpoint {host} ({EMULATOR})" if host else "the default GCS endpoint"


def version(info: dict[str, Any]) -> str:
    """The object's generation, from gcsfs's ``info``: what a replace is conditioned on."""
    return str(info["generation"])


def put(fs: Any, key: str, data: bytes, *, exclusive: bool, replacing: str | None) -> bool:
    """Write ``data`` to ``key`` (``bucket/name``) with one upload; False, writing nothing,
    if ``exclusive`` and the object exists, or if it is no longer generation ``replacing``
    (or was deleted). Other failures raise, for ``Store.errors`` to explain."""
    if replacing is None:
        try:
            fs.pipe_file(key, data, mode="create" if exclusive else "overwrite")
        except FileExistsError:  # gcsfs's name for HTTP 412
            if not exclusive:
                raise
            return False
        return True
    from google.api_core.exceptions import PreconditionFailed

    bucket, name = key.split("/", 1)
    blob = _client().bucket(bucket).blob(name)
    try:
        blob.upload_from_string(
            data, content_type="application/octet-stream", if_generation_match=int(replacing)
        )
    except PreconditionFailed:
        return False
    finally:
        fs.invalidate_cache(key)  # written past gcsfs: its listing cache may be stale
    return True


def _client() -> Any:
    """Google's storage client for the current settings, created on first use (it finds
    the emulator and the credentials itself, as gcsfs does)."""
    from google.cloud import storage

    key = tuple(os.environ.get(name) for name in SETTINGS)
    if key not in _clients:
        _clients[key] = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
    return _clients[key]


def advice(text: str, kind: str) -> str | None:
    """What to check for a failed GCS request, recognised by its text; None if unknown."""
    lowered = text.lower()
    if "forbidden" in lowered or "401" in text or "403" in text or "credentials" in lowered:
        return (
            "the credentials were refused or missing: check GOOGLE_APPLICATION_CREDENTIALS "
            "(or `gcloud auth application-default login`) and the bucket's permissions"
        )
    if "connect" in lowered or "Connect" in kind or "timeout" in lowered:
        return f"the server could not be reached at {endpoint()}: check {EMULATOR} or the network"
    return None
