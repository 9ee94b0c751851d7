"""``WarmProcess``: the ``subprocess.Popen`` face of a child forked by the warm fork server
(see ``warm.py``), so that tests which poll, wait, signal, kill or read a child's pipes
while it runs work unchanged. Its pid is a real process (signals go to it directly); its
exit status comes from the server, which is its parent, over a status socket: ``-signum``
when a signal killed it, as ``Popen.returncode`` says.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import socket
import subprocess
import threading
import time

PID_GUARD = 600  # seconds to learn the child's pid; a hang guard, never asserted


class WarmProcess:
    def __init__(self, args, spec: dict, launch, kwargs: dict, text: bool):
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self._text = text
        self._buffer = b""
        self._readers: dict[str, threading.Thread] = {}
        self._results: dict[str, object] = {}
        child_fds, close_after, ours = self._stdio(kwargs)
        try:
            self._status = launch(spec, child_fds)
        finally:
            for fd in close_after:
                os.close(fd)
        self._wrap(ours)
        self._status.settimeout(PID_GUARD)
        self.pid = int(self._line("pid"))
        self._status.settimeout(None)

    # ----------------------------------------------------------------- set-up
    def _stdio(self, kwargs: dict):
        """The child's descriptors 0-2, the ones to close once sent, and our pipe ends."""
        child, close_after, ours = [], [], {}
        for fd, name in enumerate(("stdin", "stdout", "stderr")):
            how = kwargs.get(name)
            if how is None:
                child.append(fd)
            elif how == subprocess.PIPE:
                read, write = os.pipe()
                mine, theirs = (write, read) if fd == 0 else (read, write)
                child.append(theirs)
                close_after.append(theirs)
                ours[name] = mine
            elif how == subprocess.DEVNULL:
                devnull = os.open(os.devnull, os.O_RDWR)
                child.append(devnull)
                close_after.append(devnull)
            elif how == subprocess.STDOUT and fd == 2:
                child.append(child[1])
            else:
                child.append(how if isinstance(how, int) else how.fileno())
        return child, close_after, ours

    def _wrap(self, ours: dict) -> None:
        for name, fd in ours.items():
            raw = open(fd, "wb" if name == "stdin" else "rb")  # noqa: SIM115  (Popen's pipes)
            if self._text:
                raw = io.TextIOWrapper(raw, write_through=name == "stdin")
            setattr(self, name, raw)

    def _line(self, word: str) -> str:
        while b"\n" not in self._buffer:
            chunk = self._status.recv(256)
            if not chunk:
                raise RuntimeError("the warm fork server went away before the child ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        said, value = line.decode().split(" ", 1)
        assert said == word, line
        return value

    # ----------------------------------------------------------- Popen's face
    def poll(self) -> int | None:
        if self.returncode is None and (self._buffer or _readable(self._status, 0)):
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not (self._buffer or _readable(self._status, timeout)):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        self.returncode = int(self._line("exit"))
        self._status.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):
        """Write ``input``, read both pipes to their end, wait; resumable after a
        ``TimeoutExpired`` as ``Popen.communicate`` is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._readers:
            self._start_readers(input)
        for thread in self._readers.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._results.get("stdout"), self._results.get("stderr")

    def _start_readers(self, input) -> None:
        def read(name: str) -> None:
            stream = getattr(self, name)
            self._results[name] = stream.read()
            stream.close()

        def write() -> None:
            try:
                if input:
                    self.stdin.write(input)
            except BrokenPipeError:
                pass
            finally:
                with contextlib.suppress(BrokenPipeError):
                    self.stdin.close()

        if self.stdin is not None:
            self._readers["stdin"] = threading.Thread(target=write, daemon=True)
        for name in ("stdout", "stderr"):
            if getattr(self, name) is not None:
                self._readers[name] = threading.Thread(target=read, args=(name,), daemon=True)
        for thread in self._readers.values():
            thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None and not self._readers:
                with contextlib.suppress(OSError):
                    stream.close()
        self.wait()


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    ready, _, _ = select.select([sock], [], [], timeout)
    return bool(ready)


def run_to_end(proc: WarmProcess, input, timeout, check: bool):
    """What ``subprocess.run`` does with its Popen: communicate, kill on timeout."""
    with proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as timed_out:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, timeout) from timed_out
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
