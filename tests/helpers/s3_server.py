"""A real S3-compatible server for the object-storage tests: moto's server mode on
127.0.0.1, one per test session, and a fresh bucket per test.

The tests talk the real protocol to it through the product's own path (fsspec, s3fs,
botocore over HTTP), configured only by the standard environment (``AWS_ENDPOINT_URL`` and
the keys), as a user points trainer at MinIO: nothing in the product knows it is moto.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    endpoint: str
    _fs: object = None

    @property
    def fs(self):
        """A filesystem of the tests' own, configured explicitly (not from the
        environment a test may change), to set up and inspect buckets."""
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem(
                "s3",
                skip_instance_cache=True,
                endpoint_url=self.endpoint,
                key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            )
        return self._fs

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    @contextlib.contextmanager
    def checking_credentials(self) -> Iterator[None]:
        """Inside: the server checks every request's access key (moto's documented
        ``/moto-api/reset-auth``; no key is known to it, so every request is refused as a
        real server refuses wrong credentials). Outside: it accepts any key again."""
        self._reset_auth("0")
        try:
            yield
        finally:
            self._reset_auth("inf")

    def _reset_auth(self, count: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=count.encode(),
            headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


@pytest.fixture(scope="session")
def s3_server():
    """moto's threaded server on a free port of 127.0.0.1, for the whole session."""
    from moto.server import ThreadedMotoServer  # only the store tests need moto

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


def new_bucket(server: Any, patch: pytest.MonkeyPatch, cache: Path, scheme: str = "s3") -> str:
    """Point the environment (inherited by child processes) at ``server`` (this module's
    S3 server, or ``gcs_server``'s), with the store's local cache in ``cache``; create a
    new empty bucket and return its URL."""
    for name, value in server.env().items():
        patch.setenv(name, value)
    patch.setenv("TRAINER_STORE_CACHE", str(cache))
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    server.fs.mkdir(bucket)
    return f"{scheme}://{bucket}"


@contextlib.contextmanager
def bucket_env(server: S3Server, cache: Path) -> Iterator[str]:
    """``s3_bucket`` for module-scoped fixtures, which cannot use the function-scoped
    ``monkeypatch``: the environment is put back when the block ends."""
    with pytest.MonkeyPatch.context() as patch:
        yield new_bucket(server, patch, cache)


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, tmp_path):
    """A new empty bucket on the session's server; this test's environment (inherited by
    its child processes) points at the server, and the store's local cache is in
    ``tmp_path``. Returns the bucket's URL, ``s3://<name>``. Through the test's own
    ``monkeypatch``, so that its later changes of the same variables are undone in order."""
    return new_bucket(s3_server, monkeypatch, tmp_path / "store-cache")


def objects(server: S3Server, url: str) -> list[str]:
    """Every key under ``url`` (relative to it), read straight from the server."""
    root = url[len("s3://") :].rstrip("/")
    return sorted(key[len(root) + 1 :] for key in server.fs.find(root, refresh=True))
