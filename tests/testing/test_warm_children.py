"""The warm launcher (``tests/helpers/warm.py``): a child forked from the fork server must
be indistinguishable from ``python SCRIPT`` / ``python -m trainer`` for what the tests
observe, and must fall back to a real process where a fork cannot be faithful. Real
processes throughout; the probe is ``tests/children/warm_probe.py``.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import warm
from tests.helpers.paths import CHILDREN_DIR, ROOT
from tests.helpers.processes import subprocess_env
from tests.helpers.train_py import TINY_ARGS
from tests.helpers.warm_process import WarmProcess

PROBE = CHILDREN_DIR / "warm_probe.py"
GUARD = 300  # seconds; hang guard only
SIGTERM_AT_STEP_1 = "+callbacks.sigterm={_target_: faults.SignalAtStep, step: 1}"


@pytest.fixture
def warm_only(monkeypatch):
    """These tests are about the warm path: the cold switch must not turn it off."""
    monkeypatch.delenv(warm.COLD_SWITCH, raising=False)


def probe(out, *mode, cold=False, **kwargs):
    out.mkdir(exist_ok=True)
    env = {**subprocess_env(), "WARM_PROBE_VALUE": "a=b c"}
    return warm.Popen(
        [sys.executable, str(PROBE), str(out), *mode], cwd=out, env=env, cold=cold,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def seen(out) -> dict:
    return json.loads((out / "seen.json").read_text())


def test_a_warm_child_sees_what_a_real_one_sees_and_ends_the_same(tmp_path, warm_only):
    """argv, cwd, sys.path, the environment, stdio buffering and ``__main__``; the
    non-daemon thread joined and the atexit handler run before the exit code of
    ``sys.exit(3)``; the same output."""
    ends = {}
    for how, cold in (("warm", False), ("cold", True)):
        proc = probe(tmp_path / how, "exit", "3", cold=cold)
        assert isinstance(proc, WarmProcess) != cold
        ends[how] = (*proc.communicate(timeout=GUARD), proc.returncode)
        assert (tmp_path / how / "thread").read_text() == "joined\n"
        assert (tmp_path / how / "atexit").read_text() == "ran\n"
    assert ends["warm"] == ends["cold"] == ("started\n", "", 3)
    warm_seen, cold_seen = seen(tmp_path / "warm"), seen(tmp_path / "cold")
    assert warm_seen["argv"][1:] == [str(tmp_path / "warm"), "exit", "3"]
    assert warm_seen["cwd"] == str(tmp_path / "warm")
    assert warm_seen["env"] == {"WARM_PROBE_VALUE": "a=b c"}
    for mine in (warm_seen, cold_seen):  # the folder names differ, nothing else
        mine["argv"][1] = mine["cwd"] = "OUT"
    assert warm_seen == cold_seen


@pytest.mark.parametrize(
    ("mode", "code", "says"),
    [(["raise"], 1, "ValueError: raised by the probe"), (["message"], 1, "a message")],
)
def test_an_uncaught_exception_or_an_exit_message_ends_as_an_interpreter_does(
    tmp_path, warm_only, mode, code, says
):
    proc = probe(tmp_path, *mode)
    _out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == says
    if mode == ["raise"]:  # the script's frames only, as python prints them
        assert "warm_child" not in err and "runpy" not in err, err
        assert f'File "{PROBE}"' in err
    assert (tmp_path / "atexit").is_file()


@pytest.mark.parametrize(
    ("signum", "code", "atexit_ran"),
    [(signal.SIGKILL, -9, False), (signal.SIGTERM, -15, False), (signal.SIGINT, -2, True)],
    ids=["SIGKILL", "SIGTERM", "SIGINT"],
)
def test_a_signal_ends_a_warm_child_as_it_ends_a_fresh_process(
    tmp_path, warm_only, signum, code, atexit_ran
):
    """Default dispositions: SIGKILL and SIGTERM kill (``-signum``), SIGINT raises
    KeyboardInterrupt, whose traceback is printed and which ends the process by SIGINT
    after the atexit handlers, as Python 3.8+ does."""
    proc = probe(tmp_path, "wait")
    assert proc.stdout.readline() == "started\n"
    assert proc.stdout.readline() == "waiting\n"
    assert proc.poll() is None
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == code, err
    assert (tmp_path / "atexit").is_file() == atexit_ran
    if signum == signal.SIGINT:
        assert err.strip().splitlines()[-1] == "KeyboardInterrupt"


def test_wait_with_a_timeout_raises_and_leaves_the_child_running(tmp_path, warm_only):
    proc = probe(tmp_path, "wait")
    assert proc.stdout.readline() == "started\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=GUARD) == -9
    proc.stdout.close()
    proc.stderr.close()


def test_train_py_warm_exits_2_on_an_error_and_0_on_its_own_sigterm(tmp_path, warm_only):
    """train.py's own error handling (one ``error:`` line, exit 2) and its SIGTERM handler
    (a clean stop, exit 0) in a warm child."""
    env = subprocess_env()
    bad = warm.run(
        [sys.executable, str(ROOT / "train.py"), "no_such_key=1"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=GUARD,
    )  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.startswith("error: "), bad.stderr[-3000:]
    run = tmp_path / "run"
    stopped = warm.run(
        [sys.executable, str(ROOT / "train.py"), *TINY_ARGS, SIGTERM_AT_STEP_1,
         f"hydra.run.dir={run}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=GUARD,
    )  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "Received SIGTERM" in stopped.stdout + stopped.stderr
    assert (run / "checkpoints").is_dir()


def test_an_import_time_variable_or_the_switch_runs_the_child_cold(
    tmp_path, warm_only, monkeypatch
):
    """PYTHONHASHSEED is read when the interpreter starts: a fork would keep the server's
    hash seed, so the child is a real process, which sees the fixed seed."""
    out = tmp_path / "seeded"
    out.mkdir()
    env = {**subprocess_env(), "PYTHONHASHSEED": "0"}
    proc = warm.Popen(
        [sys.executable, str(PROBE), str(out), "exit", "0"], env=env, stdout=subprocess.PIPE
    )
    assert isinstance(proc, subprocess.Popen)
    proc.communicate(timeout=GUARD)
    assert (seen(out)["hash_randomization"], seen(out)["pythonhashseed"]) == (0, "0")
    command = [sys.executable, str(ROOT / "train.py")]
    assert "KERAS_BACKEND" in warm.why_cold(command, {"env": {**env, "KERAS_BACKEND": "jax"}})
    assert warm.why_cold(command, {"env": subprocess_env()}) is None
    # A PYTHONPATH entry ahead of the server's that holds its own trainer: another copy.
    shadowing = subprocess_env()
    (tmp_path / "src-copy" / "trainer").mkdir(parents=True)
    shadowing["PYTHONPATH"] = f"{tmp_path / 'src-copy'}:{env['PYTHONPATH']}"
    assert "holds its own trainer" in warm.why_cold(command, {"env": shadowing})
    monkeypatch.setenv(warm.COLD_SWITCH, "1")
    assert warm.why_cold(command, {"env": subprocess_env()}) == f"{warm.COLD_SWITCH}=1"


def test_the_server_and_its_children_end_when_its_pytest_worker_is_gone(tmp_path):
    """The control socket's other end closing (its pytest worker died) ends the server,
    which kills the children still running: nothing outlives a dead worker. A server that
    preloads nothing, for speed; the mechanism is the same."""
    server = warm._Server(preload=False)
    spec = warm._spec([sys.executable, str(PROBE), str(tmp_path), "wait"], tmp_path, None)
    child = WarmProcess(spec["orig_args"], spec, server.launch, {"stdout": subprocess.PIPE}, True)
    assert child.stdout.readline() == "started\n"
    assert child.poll() is None and server.process.poll() is None
    server.control.close()  # what the worker's death does
    server.control = None
    assert server.process.wait(timeout=GUARD) == 0
    # Killed: its end of the pipe closed (a live child would never close it).
    assert select.select([child.stdout], [], [], GUARD)[0], "the child outlived the server"
    assert child.stdout.read() in ("", "waiting\n")
    deadline = time.monotonic() + GUARD  # its descriptors close before it is a zombie
    while not _gone_or_zombie(child.pid):
        assert time.monotonic() < deadline, "the child outlived the server"
        time.sleep(0.01)


def _gone_or_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # not reaped yet by its new parent
