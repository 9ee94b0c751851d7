"""A real S3-compatible server for the object-storage tests: moto's server mode on
127.0.0.1, one per test session, and a fresh bucket per test.

The tests talk the real protocol to it through the product's own path (fsspec, s3fs,
botocore over HTTP), configured only by the standard environment (``AWS_ENDPOINT_URL`` and
the keys), as a user points trainer at MinIO: nothing in the product knows it is moto.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}


@pytest.fixture(scope="session")
def s3_server():
    """moto's threaded server on a free port of 127.0.0.1, for the whole session."""
    from moto.server import ThreadedMotoServer  # noqa: PLC0415  (only the store tests)

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, tmp_path):
    """A new empty bucket on the session's server; this test's environment (inherited by
    its child processes) points at the server, and the store's local cache is in
    ``tmp_path``. Returns the bucket's URL, ``s3://<name>``."""
    import fsspec  # noqa: PLC0415

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINER_STORE_CACHE", str(tmp_path / "store-cache"))
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    return f"s3://{bucket}"


def objects(url: str) -> list[str]:
    """Every key under ``url`` (relative to it), read straight from the server."""
    import fsspec  # noqa: PLC0415

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    root = url[len("s3://") :].rstrip("/")
    return sorted(key[len(root) + 1 :] for key in fs.find(root))
