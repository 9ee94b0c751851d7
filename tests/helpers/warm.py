"""Warm child processes: ``run`` and ``Popen`` take the arguments of ``subprocess.run`` and
``subprocess.Popen`` and, for ``[sys.executable, SCRIPT, ...]`` and ``[sys.executable, "-m",
"trainer" | "trainer.cli", ...]``, fork the child from a server that imported TensorFlow,
Keras, Hydra and trainer once per pytest worker (``warm_server.py``; the child half is
``warm_child.py``) instead of starting an interpreter that imports them again.

Why: those imports cost ~9 CPU-seconds a child, for ~1-3 s of work, hundreds of times a run.

A child runs cold (a real ``subprocess``) wherever a fork cannot be faithful; ``why_cold``
says why, in these cases:

- ``TRAINER_TEST_COLD_CHILDREN=1``: every child, to check that both ways give the same
  results;
- another executable, interpreter options (``-c``, ``-X``, ``-W`` ...), a module other than
  the CLI's and TensorBoard's, or a ``subprocess`` keyword this module does not reproduce;
- an environment variable read while TensorFlow, Keras or Python start (``KERAS_BACKEND``,
  ``TF_ENABLE_ONEDNN_OPTS``, ``TF_CPP_*``, ``PYTHONHASHSEED``, locale ...: every name with a
  prefix in ``IMPORT_TIME_PREFIXES``) that differs from the server's: the server already
  imported under its own values;
- a PYTHONPATH whose extra entries come before the server's, or hold a module the server
  preloaded (the child would import a different copy);
- ``cold=True`` from the call site: tests about start-up itself (a signal during the
  imports, what a command imports, what the import prints).

String hashing is the one thing shared: every warm child of a worker has the server's hash
seed (a fresh interpreter draws its own), so nothing here may depend on set order.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.helpers.processes import subprocess_env
from tests.helpers.warm_process import WarmProcess, run_to_end

COLD_SWITCH = "TRAINER_TEST_COLD_CHILDREN"
WARM_MODULES = ("trainer", "trainer.cli", "tensorboard.main")
SERVER = Path(__file__).with_name("warm_server.py")
START_GUARD = 900  # seconds; against a hung server start only, never asserted
IMPORT_TIME_PREFIXES = (
    "TF_", "KERAS_", "PYTHON", "CUDA", "XLA_", "OMP_", "MKL", "KMP_", "LD_", "LC_",
    "LANG", "TENSORBOARD", "ABSL", "GRPC_", "HDF5_", "NUMPY", "OPENBLAS",
)  # fmt: skip
# Read when used, not at import. TF_CONFIG: by the cluster resolvers. TF_NUM_*_THREADS: when
# the eager context is created (checked: a warm child given 1 runs 2 fewer threads, as a
# cold one does).
READ_WHEN_USED = {"TF_CONFIG", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"}
PRELOADED_TOP = ("tensorflow", "keras", "hydra", "omegaconf", "trainer")
SUPPORTED = {"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines"}


class _Server:
    """This pytest worker's fork server, started at the first warm launch."""

    def __init__(self, preload: bool = True):
        self.preload = preload  # False: a server that imports nothing (its own tests)
        self.lock = threading.Lock()
        self.control: socket.socket | None = None
        self.env: dict[str, str] | None = None
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = subprocess_env()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The server's own output (TensorFlow's import chatter) is no child's: a file that
        # lives as long as the server.
        log = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), str(theirs.fileno()), "" if self.preload else "bare"],
            env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, cwd="/",
        )  # fmt: skip
        theirs.close()
        ours.settimeout(START_GUARD)
        try:
            ready = ours.recv(64)
        except TimeoutError:
            ready = b""
        if ready != b"ready":
            self.process.kill()
            self.process.wait(timeout=60)
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the warm fork server did not start: {tail}")
        ours.settimeout(None)
        self.control, self.env = ours, env
        atexit.register(self.stop)

    def stop(self) -> None:
        """At the worker's exit: close the control socket (the server kills what is left
        and exits) and reap the server, so that its CPU time is the worker's."""
        if self.control is not None:
            self.control.close()
            self.control = None
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=60)

    def launch(self, spec: dict, stdio: list[int]) -> socket.socket:
        """Send one request; returns the status socket that says ``pid`` and ``exit``."""
        mine, child = socket.socketpair()
        with self.lock:
            if self.control is None:
                self.start()
            socket.send_fds(self.control, [pickle.dumps(spec)], [child.fileno(), *stdio])
        child.close()
        return mine


SERVER_STATE = _Server()


def why_cold(args, kwargs: dict) -> str | None:
    """Why this child must be a real process, or None when a fork is faithful."""
    if os.environ.get(COLD_SWITCH) == "1":
        return f"{COLD_SWITCH}=1"
    if kwargs.get("cold"):
        return "the test is about start-up"
    unsupported = set(kwargs) - SUPPORTED - {"cold", "timeout", "input", "check",
                                             "capture_output"}  # fmt: skip
    if unsupported:
        return f"subprocess options {sorted(unsupported)}"
    args = [str(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable:
        return "another executable"
    if args[1] == "-m":
        if len(args) < 3 or args[2] not in WARM_MODULES:
            return "a module other than the CLI's"
    elif args[1].startswith("-") or not args[1].endswith(".py"):
        return "interpreter options"
    env = kwargs.get("env")
    env = dict(os.environ) if env is None else env
    return env_difference(env, SERVER_STATE.env or subprocess_env(), kwargs.get("cwd"))


def env_difference(env: dict, server: dict, cwd=None) -> str | None:
    names = set(env) | set(server)
    for name in sorted(names - READ_WHEN_USED - {"PYTHONPATH"}):
        if name.startswith(IMPORT_TIME_PREFIXES) and env.get(name) != server.get(name):
            return f"{name} differs from the server's (read at import time)"
    return pythonpath_difference(env.get("PYTHONPATH", ""), server.get("PYTHONPATH", ""), cwd)


def pythonpath_difference(child: str, server: str, cwd=None) -> str | None:
    ours = [p for p in server.split(os.pathsep) if p]
    theirs = [p for p in child.split(os.pathsep) if p]
    extra = [p for p in theirs if p not in ours]
    if [p for p in theirs if p in ours] != ours:
        return "PYTHONPATH lacks or reorders the server's entries"
    for entry in extra:
        entry = Path(cwd or os.getcwd(), entry)  # a relative entry is the child's cwd's
        for name in PRELOADED_TOP:
            if (Path(entry) / name).exists() or (Path(entry) / f"{name}.py").exists():
                return f"PYTHONPATH entry {entry} holds its own {name}"
    return None


def _spec(args: list[str], cwd, env) -> dict:
    if args[1] == "-m":
        kind, target, rest = "module", args[2], args[3:]
    else:
        kind, target, rest = "script", os.path.abspath(args[1]), args[2:]
    cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    if not os.path.isdir(cwd):  # what subprocess raises for a missing cwd
        raise FileNotFoundError(2, "No such file or directory", cwd)
    return {
        "kind": kind, "target": target, "args": rest, "cwd": cwd,
        "env": dict(os.environ if env is None else env),
        "executable": sys.executable, "orig_args": args[1:],
    }  # fmt: skip


def Popen(args, **kwargs):
    """A warm child (``WarmProcess``) or, where ``why_cold`` says so, ``subprocess.Popen``."""
    cold = kwargs.pop("cold", False)
    if why_cold(args, {**kwargs, "cold": cold}):
        return subprocess.Popen(args, **kwargs)
    args = [str(a) for a in args]
    spec = _spec(args, kwargs.get("cwd"), kwargs.get("env"))
    text = bool(kwargs.get("text") or kwargs.get("universal_newlines"))
    return WarmProcess(args, spec, SERVER_STATE.launch, kwargs, text)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """``subprocess.run`` through a warm child where ``why_cold`` allows."""
    cold = kwargs.pop("cold", False)
    if why_cold(args, {**kwargs, "cold": cold}):
        return subprocess.run(
            args, input=input, capture_output=capture_output, timeout=timeout, check=check,
            **kwargs,
        )  # fmt: skip
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    return run_to_end(Popen(args, **kwargs), input, timeout, check)
