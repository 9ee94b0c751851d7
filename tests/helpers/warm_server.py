"""The fork server behind ``tests.helpers.warm``: run as a script by a pytest worker, it
imports TensorFlow, Keras, Hydra, OmegaConf and trainer's entry modules once, then forks one
child per request that runs ``train.py`` or ``python -m trainer`` as a fresh interpreter
would. Why: every such child otherwise pays ~9 CPU-seconds of imports for ~1-3 s of work.

This process never creates a TensorFlow context or runs an op (a process that ran TF ops
must never fork; one that only imported TensorFlow forks fine). It is single-threaded (no
Python thread is ever started here; a fork from a multi-threaded process could inherit a
held lock). It exits when its control socket closes, i.e. when its pytest worker is gone,
and then kills the children still running.

Protocol (``warm.py`` is the other end): on the SOCK_SEQPACKET control socket the server
sends ``ready`` once imported; each request is one message, a pickled dict (argv, cwd, env,
what to run) with four descriptors: a status socket and the child's stdin, stdout, stderr.
The server answers on the status socket ``pid N`` at once and ``exit CODE`` when the child
ended (``-signum`` when a signal killed it), then closes it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import socket
import sys

# sys.path[0] is this script's folder (tests/helpers): nothing of the children's may come
# from it. What remains past PYTHONPATH is the interpreter's own path (stdlib, site).
_SCRIPT_DIR = sys.path.pop(0)
_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
BASE_PATH = [p for p in sys.path if p not in {os.path.abspath(e) for e in _PYTHONPATH}]

# What every warm child would import anyway, as train.py and the CLI import it.
PRELOAD = (
    "tensorflow",
    "keras",
    "hydra",
    "omegaconf",
    "trainer",
    "trainer.console",
    "trainer.training.interrupts",
    "trainer.training.entry",
    "trainer.cli",
    "trainer.cli.app",
)


def preload() -> None:
    import importlib

    # As train.py's quiet_tensorflow() would, before TensorFlow is imported (it then sees
    # TensorFlow imported and skips its own import; its device probe runs in the child).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    for name in PRELOAD:
        importlib.import_module(name)


class Server:
    def __init__(self, control: socket.socket):
        self.control = control
        self.children: dict[int, socket.socket] = {}  # pid -> its status socket
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C to pytest: we go with it

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.control, selectors.EVENT_READ, "control")
        selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        while True:
            for key, _ in selector.select(timeout=1.0):
                if key.data == "wake":
                    os.read(self.wake_r, 4096)
                elif not self.request():
                    return self.shutdown()
            self.reap()

    def request(self) -> bool:
        """One launch; False once the control socket closed (the pytest worker is gone)."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.control, 1 << 20, 4)
        except OSError:
            return False
        if not data:
            return False
        status = socket.socket(fileno=fds[0])
        spec = pickle.loads(data)
        pid = os.fork()
        if pid == 0:
            self.become_child(status, fds[1:], spec)
        for fd in fds[1:]:
            os.close(fd)
        self.children[pid] = status
        with contextlib.suppress(OSError):
            status.sendall(f"pid {pid}\n".encode())
        return True

    def reap(self) -> None:
        while self.children:
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            status = self.children.pop(pid, None)
            if status is None:
                continue
            with contextlib.suppress(OSError):
                status.sendall(f"exit {os.waitstatus_to_exitcode(wstatus)}\n".encode())
            status.close()

    def shutdown(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(0)

    def become_child(self, status: socket.socket, stdio: list[int], spec: dict) -> None:
        """In the forked child: drop the server's descriptors and handlers, then run."""
        try:
            signal.set_wakeup_fd(-1)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.control.close()
            status.close()
            for other in self.children.values():
                other.close()
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            for fd in set(stdio):
                if fd > 2:
                    os.close(fd)
            from tests_warm_child import run_child
        except BaseException:
            os._exit(70)
        run_child(spec, BASE_PATH)  # never returns


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    # The child half lives next to this script; import it now, under a private name, so
    # that forking costs nothing and the children's sys.path needs no tests/helpers.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tests_warm_child", os.path.join(_SCRIPT_DIR, "warm_child.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests_warm_child"] = module
    spec.loader.exec_module(module)
    if sys.argv[2:] != ["bare"]:
        preload()
    control.sendall(b"ready")
    Server(control).serve()


if __name__ == "__main__":
    main()
