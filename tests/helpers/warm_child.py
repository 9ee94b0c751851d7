"""The child half of the warm launcher: in a process just forked from the fork server
(``warm_server.py``), become what ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` is
after its interpreter started, run it, and end as that interpreter would end.

Why each step: a forked child inherits the server's state, and a test must not be able to
tell it from a fresh process. So: default signal dispositions (SIGINT raises
KeyboardInterrupt, SIGTERM kills, SIGPIPE ignored, as Python sets them at start-up); the
requested cwd, environment (``os.environ`` replaced, ``putenv`` included), ``sys.argv`` and
``sys.path`` (script folder or cwd, then PYTHONPATH, then the interpreter's own); new stdio
objects over descriptors 0-2 (a fresh interpreter line-buffers a terminal and block-buffers
a pipe, ``PYTHONUNBUFFERED`` writes through); fresh seeds for NumPy's global generator (a
fresh process draws its own; ``random`` reseeds itself after a fork). At the end, what
``Py_FinalizeEx`` does: join non-daemon threads, run atexit handlers, flush stdio; the exit
code of ``SystemExit`` (a message is printed and gives 1), a traceback and 1 for an
exception, death by SIGINT for an unhandled KeyboardInterrupt (as Python 3.8+ does).

Imports only the standard library at import time: the server imports this before
TensorFlow.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import runpy
import signal
import sys
import tempfile
import threading

_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def run_child(spec: dict, base_path: list[str]) -> None:
    """Never returns: ends the process with the exit code a real interpreter would give."""
    code = 1
    try:
        prepare(spec, base_path)
        code = run(spec)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    code = finalize(code)
    if code == "SIGINT":
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code)


def prepare(spec: dict, base_path: list[str]) -> None:
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    tempfile.tempdir = None  # recomputed from the child's TMPDIR, as a fresh process would
    pythonpath = [p for p in spec["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if spec["kind"] == "script":
        first = os.path.dirname(os.path.abspath(spec["target"]))
        sys.argv = [spec["target"], *spec["args"]]
    else:
        first = os.getcwd()
        sys.argv = ["-m", *spec["args"]]  # runpy puts the module's file in argv[0]
    # site.removeduppaths(): each entry once, the first place it appears.
    whole = [first, *(os.path.abspath(p) for p in pythonpath), *base_path]
    sys.path[:] = list(dict.fromkeys(whole))
    sys.orig_argv = [spec["executable"], *spec["orig_args"]]
    fresh_stdio(spec["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def fresh_stdio(env: dict) -> None:
    """stdin, stdout and stderr as a new interpreter creates them over descriptors 0-2."""
    buffered_stdio = not env.get("PYTHONUNBUFFERED")
    streams = []
    for fd, mode in ((0, "rb"), (1, "wb"), (2, "wb")):
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "rb":
            buffer = io.BufferedReader(raw)
        else:  # unbuffered: writes go straight to the raw file
            buffer = io.BufferedWriter(raw) if buffered_stdio else raw
        stream = io.TextIOWrapper(
            buffer,
            encoding=env.get("PYTHONIOENCODING") or None,
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=buffered_stdio and (raw.isatty() or fd == 2),
            write_through=not buffered_stdio and fd != 0,
        )
        streams.append(stream)
    sys.stdin, sys.stdout, sys.stderr = streams
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def run(spec: dict) -> int | str:
    """The exit code (or ``"SIGINT"``) of running the script or module as ``__main__``."""
    try:
        if spec["kind"] == "script":
            runpy.run_path(spec["target"], run_name="__main__")
        else:
            runpy.run_module(spec["target"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        return exit_code(stop.code)
    except KeyboardInterrupt:
        print_exception()
        return "SIGINT"
    except BaseException:
        print_exception()
        return 1
    return 0


def exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _own(filename: str) -> bool:
    return filename in _OWN_FILES or os.path.abspath(filename) in _OWN_FILES


def print_exception() -> None:
    """The traceback as the interpreter prints it: without this module's and runpy's
    frames above the script's."""
    kind, value, tb = sys.exc_info()
    while tb is not None and _own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if value is not None:  # the hook prints the exception's own traceback
        value.__traceback__ = tb
    sys.excepthook(kind, value, tb)


def finalize(code: int | str) -> int | str:
    """Py_FinalizeEx's order: non-daemon threads joined, atexit handlers, stdio flushed."""
    try:
        threading._shutdown()  # what the interpreter calls at exit (joins non-daemon threads)
    except BaseException:
        print_exception()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            if code == 0:
                code = 120
    return code
