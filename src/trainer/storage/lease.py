"""One writer per checkpoint directory on object storage: a lease object.

On disk a second writer is kept off by an advisory lock (``trainer.storage.locks``); a
store has no locks, and two machines share nothing else. What it has is a conditional
create (``If-None-Match: *``, ``Store.put_bytes(exclusive=True)``): of two writers creating
``<dir>/.lease.json`` at once, exactly one succeeds. The lease names its holder (host, PID,
a random token) and an expiry time. The holder renews it at each save and, between saves,
from a daemon thread every quarter of its lifetime, so a live writer that saves rarely (or
uploads for long) keeps it; it deletes it when it closes. A renewal is a compare-and-swap:
read the lease and its ETag, check the token is still its own, and PUT only if the ETag is
unchanged (``If-Match``), so a takeover landing in between is never overwritten. A
writer that died (SIGKILL, a lost machine) cannot release it, so a lease past its expiry is
taken over: deleted, then created again exclusively; whoever loses that second race is
refused. A holder on this host whose process is gone is taken over at once, without
waiting for the expiry (a killed job restarted on the same machine).

The expiry (``TRAINER_STORE_LEASE_SECONDS``, default 600) is how long a job restarted on
*another* machine after a SIGKILL waits at most (a run stopped by SIGTERM or ending normally
releases its lease at once); the background renewal makes it independent of the save
interval. It must exceed the longest stall of a live process (its renewal thread must run at
least once in three quarters of it). A holder that finds its lease taken over stops with
``DirectoryInUseError`` at its next save instead of writing beside the new one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.errors import ConfigError, DirectoryInUseError, StoreError
from trainer.storage.store import Store

LEASE = ".lease.json"
ENV = "TRAINER_STORE_LEASE_SECONDS"
DEFAULT_SECONDS = 600.0
RENEWALS_PER_LIFETIME = 4  # the background renewal runs every quarter of the lifetime

log = logging.getLogger(__name__)


def lease_seconds() -> float:
    """The lease's lifetime from ``TRAINER_STORE_LEASE_SECONDS`` (default 600)."""
    raw = os.environ.get(ENV)
    if raw is None or not raw.strip():
        return DEFAULT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(
            f"{ENV} must be a positive number of seconds (how long a checkpoint writer's "
            f"lease on object storage lasts without a save). Set it to e.g. 600 or unset it. "
            f"Received: {raw!r}"
        )
    return seconds


class Lease:
    """This process's claim to write the checkpoint directory ``store`` holds."""

    def __init__(
        self,
        store: Store,
        seconds: float | None = None,
        *,
        on_acquire: Callable[[], Any] | None = None,
    ):
        self.store = store
        self.seconds = lease_seconds() if seconds is None else float(seconds)
        self.token: str | None = None  # set while held
        self._lock = threading.RLock()  # saves and the renewal thread
        self._lost: DirectoryInUseError | None = None  # found by the renewal thread
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        # Run each time the lease is taken (not renewed): what only the one writer may
        # do before it writes, such as cleaning a killed writer's leftovers.
        self.on_acquire = on_acquire

    @property
    def url(self) -> str:
        return self.store.url_of(LEASE)

    @property
    def held(self) -> bool:
        return self.token is not None

    def hold(self) -> None:
        """Acquire the lease, or renew it if held. Raises ``DirectoryInUseError`` if
        another live writer holds it, or if this one's was taken over."""
        with self._lock:
            if self._lost is not None:
                lost, self._lost = self._lost, None
                raise lost
            if self.token is not None:
                self._renew()
                return
            self._acquire()
            self._start_renewing()
        if self.on_acquire is not None:  # outside the lock: renewed while it cleans
            self.on_acquire()

    def release(self) -> None:
        """Delete the lease if it is still this writer's (never another's)."""
        self._stop_renewing()
        with self._lock:
            token, self.token = self.token, None
            self._lost = None
            if token is None:
                return
            current = self._read()
            if current is not None and current.get("token") == token:
                self.store.delete([LEASE])

    # ------------------------------------------------------------ renewal
    def _renew(self) -> None:
        """Compare-and-swap the lease for one with a later expiry; refuse if it is no
        longer this writer's."""
        found = self.store.get_versioned(LEASE)
        if found is None:  # deleted by hand, or by a taker not done yet: ours if we win
            if self.store.put_bytes(LEASE, self._body(), exclusive=True):
                return
            current = self._read()
        else:
            current = _parse(found[0])
            if current.get("token") == self.token and self.store.put_bytes(
                LEASE, self._body(), replacing=found[1]
            ):
                return
            current = self._read()  # taken over, possibly between our read and write
        self.token = None
        raise self._refusal(
            current,
            "this writer's lease expired and was taken over (it was not renewed within "
            f"{self.seconds:g} s), so another writer may be saving there now",
        )

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(
            target=self._renew_until_stopped, name="trainer-store-lease", daemon=True
        )
        self._renewer.start()

    def _stop_renewing(self) -> None:
        self._stop.set()
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()

    def _renew_until_stopped(self) -> None:
        """The renewal thread: renew every ``seconds / RENEWALS_PER_LIFETIME``. A store
        error is logged and retried at the next tick (the lease lasts three more); a
        takeover ends the thread and is raised by the next ``hold`` (the next save)."""
        while not self._stop.wait(self.seconds / RENEWALS_PER_LIFETIME):
            with self._lock:
                if self._stop.is_set() or self.token is None:
                    return
                try:
                    self._renew()
                except DirectoryInUseError as error:
                    self._lost = error
                    return
                except StoreError as error:
                    log.warning("Could not renew the writer's lease %s: %s", self.url, error)

    # ----------------------------------------------------------------- internals
    def _acquire(self) -> None:
        token = secrets.token_hex(16)
        if self.store.put_bytes(LEASE, self._body(token), exclusive=True):
            self.token = token
            return
        current = self._read()
        if current is not None and not _dead(current):
            raise self._refusal(current, "another writer holds its lease")
        # Expired (or its process is gone): take it over. Of two writers doing this at
        # once, both may delete, but only one exclusive create succeeds.
        self.store.delete([LEASE])
        if not self.store.put_bytes(LEASE, self._body(token), exclusive=True):
            raise self._refusal(self._read(), "another writer took the expired lease first")
        self.token = token

    def _body(self, token: str | None = None) -> bytes:
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "token": token or self.token,
                "expires": time.time() + self.seconds,
            }
        ).encode()

    def _read(self) -> dict[str, Any] | None:
        """The lease's content; an unreadable one counts as expired ({})."""
        data = self.store.get_bytes(LEASE)
        return None if data is None else _parse(data)

    def _refusal(self, current: dict[str, Any] | None, why: str) -> DirectoryInUseError:
        current = current or {}
        expires = current.get("expires")
        until = (
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
            if isinstance(expires, int | float)
            else "unknown"
        )
        return DirectoryInUseError(
            f"{self.store.url} cannot be written: {why}: PID {current.get('pid', '?')} on "
            f"host {current.get('host', '?')}, lease valid until {until}. Two writers on one "
            f"checkpoint directory would delete each other's checkpoints. Wait for that run "
            f"to finish or stop it, write to another URL, or, if it is surely dead, delete "
            f"{self.url} (its lease lasts {ENV}={self.seconds:g} s without a save). "
            f"Received: {self.url!r}"
        )


def _parse(data: bytes) -> dict[str, Any]:
    try:
        content = json.loads(data)
    except ValueError:
        return {}
    return content if isinstance(content, dict) else {}


def _dead(current: dict[str, Any]) -> bool:
    """Whether the holder is gone: its lease expired (or is unreadable), or it ran on this
    host and its process no longer exists."""
    expires = current.get("expires")
    if not isinstance(expires, int | float) or expires <= time.time():
        return True
    pid = current.get("pid")
    if current.get("host") != socket.gethostname() or type(pid) is not int or pid <= 0:
        return False
    if pid == os.getpid():
        return False  # another manager of this very process: live
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by another user
    return False
