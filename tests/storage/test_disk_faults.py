"""Disk faults for real: a file-size limit (RLIMIT_FSIZE, in a child process) makes writes
fail with EFBIG exactly where a full disk fails with ENOSPC, and an immutable directory
(``chattr +i``, which binds root too) refuses writes with EPERM.

Before the fix, h5py crashed the whole process (SIGSEGV) when its write failed; the child
processes here would die with -11 instead of printing their report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import warm
from tests.helpers.fault_corpus import BACKENDS, build_model
from tests.helpers.paths import CHILDREN_DIR
from tests.helpers.processes import subprocess_env
from trainer.errors import SavePermissionError
from trainer.save_backends import get_backend, load_checkpoint

CHILD = CHILDREN_DIR / "disk_fault_child.py"


TRAIN_CASES = {
    "h5-sync-continue": ("h5", "continue"),
    "weights-async-raise": ("weights", "raise"),
    "weights-async-continue": ("weights", "continue"),
}


class Child:
    """A child process started now and read later, so that the slow cases overlap."""

    def __init__(self, *args: str):
        env = subprocess_env()
        env["PYTHONPATH"] = f"{CHILDREN_DIR}:{env['PYTHONPATH']}"
        self.process = warm.Popen(
            [sys.executable, str(CHILD), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def report(self, timeout: int = 300) -> object:
        if hasattr(self, "_report"):
            return self._report
        try:
            out, err = self.process.communicate(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        code = self.process.returncode
        assert code == 0, f"child died with {code} (-11 = the h5py segfault): {err[-3000:]}"
        self._report = json.loads(out.strip().splitlines()[-1])
        return self._report


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """All disk-full children, started together (two cores run them in ~half the time)."""
    cases = [f"{name}={backend}:{on_error}" for name, (backend, on_error) in TRAIN_CASES.items()]
    started = {
        "backends": Child("backends", str(tmp_path_factory.mktemp("backends"))),
        "train": Child("train", str(tmp_path_factory.mktemp("train")), "400000", *cases),
    }
    yield started
    for child in started.values():
        if child.process.poll() is None:
            child.process.kill()
            child.process.communicate()


@pytest.mark.slow
def test_out_of_space_during_a_save_of_every_backend(children):
    records = children["backends"].report()
    assert {r["backend"] for r in records} == {"h5", "weights", "savedmodel", "savedmodel-full"}
    for record in records:
        where = f"{record['backend']} with a {record['limit']}-byte limit"
        assert record["error"] is not None, f"{where}: the save claimed success"
        assert record["error"]["type"] == "DiskFullError", f"{where}: {record['error']}"
        assert "previous checkpoints" in record["error"]["message"]
        assert record["after"] == record["before"], f"{where}: temporary or partial left"
        assert record["previous_intact"], f"{where}: the earlier checkpoint changed"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_training_with_a_full_disk(children, case):
    """Steps 1-4 fit, then no file may exceed 400 kB (a checkpoint is ~1 MB; the
    TensorBoard event file stays below): training stops or continues, as configured."""
    report = children["train"].report()[case]
    assert report["temporaries"] == []
    assert report["checkpoints"], "the checkpoints written before the fault are gone"
    assert report["latest_step"] == max(report["checkpoints"].values())
    assert report["latest_step"] in (3, 4)  # step 4's async write may overlap the limit
    if TRAIN_CASES[case][1] == "continue":
        assert report["finished"], report
    else:
        assert not report["finished"] and report["error"] == "DiskFullError", report
        assert "previous checkpoints" in report["message"]


@pytest.fixture
def immutable(tmp_path):
    """``immutable(path)`` sets the immutable attribute; lifted again at teardown."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr not available")
    locked = []

    def lock(path):
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"this filesystem has no immutable attribute: {done.stderr!r}")
        locked.append(path)

    yield lock
    for path in locked:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.mark.parametrize("backend", BACKENDS)
def test_permission_denied_keeps_the_previous_checkpoint(tmp_path, immutable, model, backend):
    directory = tmp_path / "checkpoints"
    good = get_backend(backend).save(model, directory / "good")
    immutable(directory)
    with pytest.raises(SavePermissionError, match=r"not permitted.*previous checkpoints") as info:
        get_backend(backend).save(model, directory / "next")
    assert isinstance(info.value, OSError) and info.value.errno is not None
    assert sorted(p.name for p in directory.iterdir()) == [good.name]
    assert load_checkpoint(good, verify=True).state.global_step == 0
