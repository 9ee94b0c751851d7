"""Object storage behind a URL (``s3://bucket/prefix``, ``gs://bucket/prefix``): the few
operations checkpoints need, on the ecosystem's filesystem layer (fsspec with s3fs or
gcsfs), with every failure turned into one ``StoreError`` line.

The endpoint and credentials are the ones users already have for other S3 tools
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``, ``~/.aws/config``, fsspec's own configuration): botocore reads them,
so a MinIO or another S3-compatible server works by setting the endpoint alone. fsspec and
s3fs are an optional extra (``pip install "trainer[s3]"``), imported on the first URL only:
a user who never names one pays nothing for it. ``gs://`` URLs differ in a few places
only (credentials, conditional writes on generations), all in ``trainer.storage.gcs``.

Object stores have no rename, no directories and no locks; what stands in for them (a
commit marker written last, one object replaced by one PUT, a conditional create) is built
from the operations here by ``trainer.storage.remote``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.errors import StoreError, UnsupportedLocationError
from trainer.storage import gcs
from trainer.storage.locations import url_scheme

# Schemes served here, with the distribution that provides each one's filesystem and the
# extra that installs it.
SCHEMES = {"s3": "s3fs", "gs": "gcsfs"}
INSTALL = {"s3": 'pip install "trainer[s3]"', "gs": 'pip install "trainer[gcs]"'}

# Settings a filesystem is created from: a changed one (another endpoint, other keys)
# gets a new instance, the same ones share theirs (and its connections).
_SETTINGS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    *gcs.SETTINGS,
)
_filesystems: dict[tuple, Any] = {}


def filesystem(scheme: str) -> Any:
    """The fsspec filesystem of ``scheme`` for the current environment's settings,
    created on first use."""
    try:
        import fsspec  # an optional extra: imported on the first URL only

        key = (scheme, *(os.environ.get(name) for name in _SETTINGS))
        if key not in _filesystems:
            extra = gcs.options() if scheme == "gs" else {}
            _filesystems[key] = fsspec.filesystem(scheme, skip_instance_cache=True, **extra)
        return _filesystems[key]
    except ImportError as error:
        raise UnsupportedLocationError(
            f"A {scheme}:// location needs the optional packages fsspec and {SCHEMES[scheme]}, "
            f"which are not installed. Install them with: {INSTALL[scheme]}. Received: {error}"
        ) from None


class Store:
    """The objects under one URL prefix (``s3://bucket/runs/x/checkpoints``), addressed by
    relative keys (``ckpt-10/model.weights.h5``). Every method raises ``StoreError`` (or
    returns None / False for an absent object where it says so), never a raw botocore or
    fsspec error."""

    def __init__(self, url: str):
        scheme = url_scheme(url)
        if scheme is None:
            raise UnsupportedLocationError(
                f"Store needs a URL such as s3://bucket/prefix. Received: {url!r}"
            )
        if scheme not in SCHEMES:
            raise UnsupportedLocationError(
                f"trainer keeps data on object storage through s3:// URLs (any "
                f"S3-compatible server, with AWS_ENDPOINT_URL) and gs:// URLs (Google Cloud "
                f"Storage) only; {scheme}:// is not supported. Use one of those or a local "
                f"path. Received: {url!r}"
            )
        self.scheme = scheme
        self.fs = filesystem(scheme)
        self.root = url[len(scheme) + 3 :].strip("/")
        if not self.root:
            raise UnsupportedLocationError(
                f"The URL names no bucket; give {scheme}://<bucket>/<prefix>. Received: {url!r}"
            )
        self.url = f"{scheme}://{self.root}"
        self.bucket = self.root.split("/", 1)[0]

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def key(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def url_of(self, relative: str) -> str:
        return f"{self.scheme}://{self.key(relative)}"

    def child(self, relative: str) -> Store:
        return Store(self.url_of(relative))

    # --------------------------------------------------------------------- reads
    def get_bytes(self, relative: str) -> bytes | None:
        """The object's bytes, or None if there is no such object (the bucket exists)."""
        with self.errors("read", relative):
            try:
                return self.fs.cat_file(self.key(relative))
            except FileNotFoundError:
                self.check_bucket()
                return None

    def get_range(self, relative: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` of the object (one ranged GET)."""
        with self.errors("read", relative):
            return self.fs.cat_file(self.key(relative), start=start, end=end)

    def get_file(self, relative: str, local: Path) -> None:
        with self.errors("download", relative):
            self.fs.get_file(self.key(relative), os.fspath(local))

    def get_files(self, pairs: list[tuple[str, Path]]) -> None:
        """Download several objects (relative key, local path) in one call: s3fs runs
        the transfers concurrently, as its own recursive ``get`` does, instead of one
        request round trip after another."""
        if not pairs:
            return
        with self.errors("download", pairs[0][0]):
            self.fs.get(
                [self.key(relative) for relative, _ in pairs],
                [os.fspath(local) for _, local in pairs],
            )

    def list(self, relative: str = "") -> list[str]:
        """Names (not keys) directly under ``relative``: objects and common prefixes;
        [] if there is none (the bucket exists)."""
        with self.errors("list", relative):
            try:
                found = self.fs.ls(self.key(relative), detail=False, refresh=True)
            except FileNotFoundError:
                self.check_bucket()
                return []
        prefix = self.key(relative).rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))

    def walk(self, relative: str) -> list[str]:
        """Every object under ``relative`` (recursively), as keys relative to it."""
        with self.errors("list", relative):
            found = self.fs.find(self.key(relative), refresh=True)
        prefix = self.key(relative).rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))

    def walk_name(self, relative: str) -> list[str]:
        """The object ``relative`` and every object under ``relative/``, as keys relative to
        this store (one listing request: a checkpoint is one file or one prefix)."""
        key = self.key(relative)
        with self.errors("list", relative):
            found = self.fs.find(key, refresh=True)
        root = self.key("").rstrip("/") + "/"
        return sorted(p[len(root) :] for p in found if p == key or p.startswith(key + "/"))

    def check_bucket(self) -> None:
        """Raise ``StoreError`` if the bucket does not exist (an absent object under a
        missing bucket is a misconfiguration, not "no checkpoint yet")."""
        with self.errors("open", ""):
            try:
                self.fs.ls(self.bucket, detail=False, refresh=True)
            except FileNotFoundError:
                raise StoreError(
                    f"The bucket {self.bucket!r} of {self.url} does not exist at "
                    f"{_endpoint(self.scheme)}. Create it, or fix the URL or "
                    f"{_ENDPOINT_SETTING[self.scheme]}. "
                    f"Received: {self.url!r}"
                ) from None

    # -------------------------------------------------------------------- writes
    def get_versioned(self, relative: str) -> tuple[bytes, str] | None:
        """The object's bytes and the version they had (S3's ETag, GCS's generation), or
        None if there is no such object. The version is read first: if the object changes
        between the two reads, a ``put_bytes(..., replacing=version)`` of the caller fails,
        so a successful replace always replaced the bytes returned here."""
        with self.errors("read", relative):
            try:
                info = self.fs.info(self.key(relative), refresh=True)
                etag = gcs.version(info) if self.scheme == "gs" else info["ETag"]
                return self.fs.cat_file(self.key(relative)), etag
            except FileNotFoundError:
                self.check_bucket()
                return None

    def put_bytes(
        self, relative: str, data: bytes, *, exclusive: bool = False, replacing: str | None = None
    ) -> bool:
        """Write one object with one PUT (readers see the old or the new bytes, never a
        mix). Returns False, writing nothing, when a condition does not hold:

        Args:
            relative: The object's key under this store's prefix.
            data: Its new bytes.
            exclusive: Only if no object has that key (``If-None-Match: *``, a conditional
                write S3 and S3-compatible servers honour; ``ifGenerationMatch=0`` on GCS).
            replacing: Only if the object still has this version from ``get_versioned``
                (``If-Match``; ``ifGenerationMatch`` on GCS): a compare-and-swap, for an
                object two writers may race on.
        """
        if self.scheme == "gs":
            with self.errors("write", relative):
                return gcs.put(
                    self.fs, self.key(relative), data, exclusive=exclusive, replacing=replacing
                )
        options = {"IfNoneMatch": "*"} if exclusive else {}
        if replacing is not None:
            options["IfMatch"] = replacing
        with self.errors("write", relative):
            try:
                self.fs.pipe_file(self.key(relative), data, **options)
            except FileExistsError:
                if not exclusive:
                    raise
                return False
            except FileNotFoundError:
                if replacing is None:
                    raise
                return False  # deleted since its ETag was read
            except OSError as error:
                if replacing is None or not _precondition_failed(error):
                    raise
                return False
        return True

    def put_file(self, local: Path, relative: str) -> None:
        with self.errors("upload", relative):
            self.fs.put_file(os.fspath(local), self.key(relative))

    def put_files(self, pairs: list[tuple[Path, str]]) -> None:
        """Upload several files (local path, relative key) in one call, concurrently (see
        ``get_files``). Each object still appears whole, by its own PUT."""
        if not pairs:
            return
        with self.errors("upload", pairs[0][1]):
            self.fs.put(
                [os.fspath(local) for local, _ in pairs],
                [self.key(relative) for _, relative in pairs],
            )

    def delete(self, relatives: list[str]) -> None:
        """Delete these objects, in the order given (absent ones are skipped)."""
        for relative in relatives:
            with self.errors("delete", relative), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.key(relative))

    def delete_all(self, relatives: list[str]) -> None:
        """Delete these objects in any order, in batched requests (S3's DeleteObjects, up
        to 1000 keys each; absent ones are skipped): for objects no marker lists any more,
        where one DELETE after another only adds round trips."""
        if len(relatives) <= 1:
            self.delete(relatives)
            return
        with self.errors("delete", relatives[0]), contextlib.suppress(FileNotFoundError):
            self.fs.rm([self.key(relative) for relative in relatives])

    # -------------------------------------------------------------------- errors
    @contextlib.contextmanager
    def errors(self, action: str, relative: str) -> Iterator[None]:
        """Turn what the filesystem layer raises into one ``StoreError`` line saying what
        failed, where, and what to check. ``FileNotFoundError`` / ``FileExistsError`` pass:
        the callers decide what an absent object means."""
        try:
            yield
        except (StoreError, FileNotFoundError, FileExistsError):
            raise
        except Exception as error:
            raise StoreError(_explain(self, action, relative, error)) from None


def _precondition_failed(error: OSError) -> bool:
    """Whether the server refused a conditional write because its condition did not hold
    (HTTP 412; s3fs reports an ``If-Match`` one as a plain ``OSError``)."""
    response = getattr(error.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")


_ENDPOINT_SETTING = {"s3": "AWS_ENDPOINT_URL", "gs": gcs.EMULATOR}


def _endpoint(scheme: str = "s3") -> str:
    if scheme == "gs":
        return gcs.endpoint()
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"endpoint {endpoint}" if endpoint else "the default AWS endpoint"


def _explain(store: Store, action: str, relative: str, error: Exception) -> str:
    """One line for a failed store operation: the cause users can act on, recognised by
    the exception type or the server's error code in its text."""
    where = store.url_of(relative)
    kind = type(error).__name__
    text = str(error) or kind
    found = gcs.advice(text, kind) if store.scheme == "gs" else None
    if found is not None:
        advice = found
    elif isinstance(error, PermissionError) or any(
        code in text
        for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403")
    ):
        advice = (
            "the credentials were refused: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or the profile) and the bucket's permissions"
        )
    elif "NoCredentials" in kind or "Unable to locate credentials" in text:
        advice = "no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    elif "Connect" in kind or "connect" in text.lower() or "Endpoint" in kind:
        advice = f"the server could not be reached at {_endpoint()}: check AWS_ENDPOINT_URL"
    elif "NoSuchBucket" in text or "bucket does not exist" in text:
        advice = f"the bucket {store.bucket!r} does not exist: create it or fix the URL"
    else:
        advice = f"check the URL, {_ENDPOINT_SETTING[store.scheme]} and the credentials"
    return (
        f"Could not {action} {where} on object storage ({_endpoint(store.scheme)}): {advice}. "
        f"Received: {kind}: {text[:300]}"
    )
