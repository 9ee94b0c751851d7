"""Serving exports under real workflows (issue 16, items 4, 8 and 10): ``verify`` passes on
every export trainer writes and still catches changed, added and removed files; export
temporaries have one hidden name and stale ones are cleaned; pruning never leaves a
half-deleted version under a real name; ``python -m trainer export`` only reads the
source run and writes a TensorBoard card only where it is told, with unique tags."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import pytest

from tests.helpers import warm
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from tests.helpers.tb_runs import make_run
from trainer.cli.app import main
from trainer.cli.verify import verify_checkpoint
from trainer.errors import IntegrityError
from trainer.exports.exporter import (
    EXPORT_FILE,
    export_serving,
    read_export_metadata,
    versions,
)
from trainer.exports.sources import export_from_checkpoint
from trainer.exports.warmup import EXTRA_DIR, WARMUP_FILE
from trainer.tensorboard.links import event_steps, resolve_link
from trainer.training.loop import train

ONE_TEMPORARY = re.compile(r"^\.[0-9]+\.tmp-[0-9]+-[0-9a-f]+$")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    return make_run(outputs / "run0", backends=("h5", "weights", "savedmodel"), epochs=3)


def trainer_cli(*args: str) -> subprocess.CompletedProcess:
    return warm.run(
        [sys.executable, "-m", "trainer", *map(str, args)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with its SHA-256: equal snapshots, nothing written."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------ item 8: verify
@pytest.mark.parametrize("format", ["keras", "savedmodel"])
def test_verify_passes_on_exports_with_warmup_of_each_format(run, tmp_path, format):
    x = run["data"].x_val[:3]
    path = export_serving(run["model"], tmp_path / "export", warmup=x, format=format)
    assert (path / EXTRA_DIR / WARMUP_FILE).is_file()
    report = verify_checkpoint(path)
    assert report["kind"] == "export" and report["exported_with"] == format
    assert report["warmup_requests"] == 3 and "serving_default" in report["signatures"]
    listed = set(snapshot(path)) - {f"{EXTRA_DIR}/trainer_manifest.json"}
    assert report["files"] == len(listed)  # the manifest covers every other file
    if format == "savedmodel":
        assert report["num_params"] == run["model"].count_params()


@pytest.mark.parametrize("index", [0, 1, 2], ids=["h5", "weights", "savedmodel"])
def test_verify_passes_on_cli_style_exports_of_every_backend(run, tmp_path, index):
    source = run["checkpoints"][index]["path"]
    path = export_from_checkpoint(source, tmp_path / "served", warmup=2)
    assert verify_checkpoint(path)["warmup_requests"] == 2


def test_verify_passes_on_the_export_training_writes(compose_cfg, tmp_path):
    train(compose_cfg("model=mlp", "save=h5", "export.enabled=true", "export.warmup_examples=2"))
    (path,) = (tmp_path / "run" / "export").iterdir()
    result = trainer_cli("verify", path)
    assert result.returncode == 0, result.stderr
    assert "serving export version 1 (savedmodel)" in result.stdout
    assert "2 warmup request(s)" in result.stdout
    # Training-time exports still link to (and have a card in) their own run's log.
    meta = read_export_metadata(path)
    resolved = resolve_link(path, meta)
    assert resolved.log_dir == tmp_path / "run" / "tb"
    assert meta["tensorboard"]["tag"] in event_steps(resolved.event_file)[resolved.step]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file"),
    [
        (lambda p: _flip_last_byte(p / EXTRA_DIR / WARMUP_FILE), WARMUP_FILE),
        (lambda p: _flip_last_byte(p / EXTRA_DIR / EXPORT_FILE), EXPORT_FILE),
        (lambda p: (p / EXTRA_DIR / WARMUP_FILE).unlink(), WARMUP_FILE),
        (lambda p: (p / EXTRA_DIR / "extra.txt").write_text("added"), "extra.txt"),
        (lambda p: (p / "variables" / "variables.index").unlink(), "variables.index"),
    ],
    ids=["changed-warmup", "changed-metadata", "removed-warmup", "added", "removed-index"],
)
def test_verify_still_fails_when_an_export_changes_afterwards(run, tmp_path, damage, file):
    path = export_serving(run["model"], tmp_path / "e", warmup=run["data"].x_val[:2])
    verify_checkpoint(path, load=False)
    damage(path)
    with pytest.raises(IntegrityError, match=re.escape(file)):
        verify_checkpoint(path)


# ------------------------------------------------------- item 4: export temporaries
LISTINGS: list[list[str]] = []
WATCHED: list[Path] = []


@keras.saving.register_keras_serializable(package="test_export_workflow")
class ListingDense(keras.layers.Dense):
    """A Dense layer with an asset file; while it is saved it notes what the export root
    holds, which shows the names the export's temporaries get."""

    def save_assets(self, dir_path):
        LISTINGS.append(sorted(os.listdir(WATCHED[0])))
        Path(dir_path, "note.txt").write_text("seen")

    def load_assets(self, dir_path):
        pass


def test_an_export_uses_one_hidden_temporary_name(tmp_path):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, ListingDense(2, name="listing")(inputs))
    model.compile("sgd", "mse")
    root = tmp_path / "export"
    WATCHED[:] = [root]
    LISTINGS.clear()
    path = export_serving(model, root, format="savedmodel")
    assert LISTINGS, "the layer's assets were not saved"
    seen = {name for listing in LISTINGS for name in listing}
    assert seen and all(ONE_TEMPORARY.match(name) for name in seen), seen
    assert os.listdir(root) == ["1"] and verify_checkpoint(path)["num_params"] == 10


@contextlib.contextmanager
def live_process():
    """A real process that stays alive for the duration (its PID owns a temporary)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_export_temporaries_are_cleaned_but_live_ones_kept(run, tmp_path):
    root = tmp_path / "export"
    export_serving(run["model"], root, format="keras")
    dead = dead_pid()
    stale = [
        root / f".2.tmp-{dead}-0a1b2c3d",  # a killed export
        root / f"..2.tmp-{dead}-0a1b2c3d.tmp-{dead}-4e5f6a7b",  # older doubled name
        root / f".1.tmp-{dead}-9f8e7d6c",  # a killed prune
    ]
    for directory in stale:
        (directory / "variables").mkdir(parents=True)
        (directory / "saved_model.pb").write_bytes(b"partial")
    with live_process() as pid:
        live = root / f".3.tmp-{pid}-11223344"
        live.mkdir()
        path = export_serving(run["model"], root, format="keras")
        assert live.is_dir()  # another exporter's write in progress: never deleted
    assert path.name == "2"
    assert not any(directory.exists() for directory in stale)
    assert sorted(os.listdir(root)) == sorted(["1", "2", live.name])


EXPORT_FOREVER = """
import sys, keras
from trainer.exports.exporter import export_serving
inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
model.compile("sgd", "mse")
while True:
    export_serving(model, sys.argv[1], keep=2, format="savedmodel")
"""


def test_an_export_killed_mid_write_is_cleaned_by_the_next_one(run, tmp_path):
    """SIGKILL a real exporter while its temporary exists; the next export removes what
    it left, and every version left verifies."""
    root = tmp_path / "export"
    child = subprocess.Popen(
        [sys.executable, "-c", EXPORT_FOREVER, str(root)], env=subprocess_env(), cwd=ROOT
    )
    try:
        for _ in range(6000):  # until a temporary is seen (at most about 10 minutes)
            names = os.listdir(root) if root.is_dir() else []
            if any(name.startswith(".") for name in names) or child.poll() is not None:
                break
            time.sleep(0.1)
        child.kill()
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    left = [name for name in os.listdir(root) if name.startswith(".")]
    assert all(ONE_TEMPORARY.match(name) for name in left), left
    path = export_serving(run["model"], root, keep=2, format="savedmodel")
    assert all(name.isdigit() for name in os.listdir(root)), os.listdir(root)
    for version in versions(root):
        verify_checkpoint(root / str(version), load=version == int(path.name))


@contextlib.contextmanager
def undeletable(path: Path):
    """Make the file ``path`` impossible to delete (immutable as root, a read-only parent
    directory otherwise), so a removal of its directory stops half way."""
    if os.geteuid() == 0:
        result = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
        if result.returncode:
            pytest.skip(f"chattr +i is not available here: {result.stderr!r}")
        undo = ["chattr", "-i"]
    else:
        os.chmod(path.parent, 0o555)
        undo = None
    try:
        yield
    finally:
        for found in path.parent.parent.parent.rglob(path.name):
            if undo:
                subprocess.run([*undo, str(found)], check=False)
            else:
                os.chmod(found.parent, 0o755)


def test_pruning_never_leaves_a_half_deleted_version_under_a_real_name(run, tmp_path):
    root = tmp_path / "export"
    first = export_serving(run["model"], root, keep=1, format="keras")
    with undeletable(first / "variables" / "variables.index"):
        second = export_serving(run["model"], root, keep=1, format="keras")
        assert versions(root) == [2] and second.name == "2"
        assert not first.exists()  # renamed away whole; what could not be removed is hidden
        leftovers = [name for name in os.listdir(root) if name != "2"]
        assert all(ONE_TEMPORARY.match(name) for name in leftovers), leftovers


# ------------------------------------------------------------ item 10: CLI export
@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` read-only for this process: a read-only bind mount as root (which
    ignores permission bits), permission bits otherwise. Yields whether it worked (root
    without the right to mount: False, and the directory stays writable)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")]}
        for p in modes:
            os.chmod(p, modes[p] & ~0o222)
        try:
            yield True
        finally:
            for p, mode in modes.items():
                os.chmod(p, mode)
        return
    mounted = False
    try:
        for step in (["--bind"], ["-o", "remount,bind,ro"]):
            result = subprocess.run(
                ["mount", *step, str(directory), str(directory)], capture_output=True, check=False
            )
            mounted = mounted or result.returncode == 0
            if result.returncode:
                break
        else:
            yield True
            return
        yield False
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


def test_cli_export_only_reads_the_source_run_and_cards_only_where_told(run, tmp_path, capsys):
    run_dir = run["run_dir"]
    source = run["checkpoints"][2]
    before = snapshot(run_dir)
    board_dir = tmp_path / "board"
    outs = [tmp_path / "a" / "served", tmp_path / "b" / "served", tmp_path / "c" / "served"]
    with read_only(run_dir) as protected:
        if protected:
            with pytest.raises(OSError):
                (run_dir / "tb" / "probe").write_text("x")
        assert main(["export", str(source["path"]), str(outs[0])]) == 0  # no log at all
        for out in outs[1:]:
            args = ["export", str(source["path"]), str(out), "--tensorboard", str(board_dir)]
            assert main(args) == 0, capsys.readouterr().err
    assert snapshot(run_dir) == before  # nothing written into the source run
    assert not (outs[0].parent / "tb").exists() and not list(tmp_path.glob("a/**/*.v2"))

    plain = read_export_metadata(outs[0] / "1")
    assert "tensorboard" not in plain
    assert plain["checkpoint_tensorboard"]["event_file"] == run["event_file"].name
    tags = []
    for out in outs[1:]:
        meta = read_export_metadata(out / "1")
        resolved = resolve_link(out / "1", meta)
        assert resolved.log_dir == board_dir and resolved.step == source["step"]
        assert meta["tensorboard"]["tag"] in event_steps(resolved.event_file)[source["step"]]
        tags.append(meta["tensorboard"]["tag"])
        assert meta["checkpoint_tensorboard"]["run_name"] == "run0/tb"
    assert len(set(tags)) == len(tags) == 2, tags
    everything = set()
    for event_file in board_dir.glob("events.*"):
        for step_tags in event_steps(event_file).values():
            everything |= {t for t in step_tags if t.startswith("exports/")}
    assert everything == set(tags)


def test_cli_export_into_an_unwritable_tensorboard_dir_is_one_error_line(run, tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log directory should be")
    out = tmp_path / "served"
    code = main(["export", str(run["checkpoints"][0]["path"]), str(out), "--tensorboard",
                 str(blocker / "tb")])  # fmt: skip
    assert code == 2
    assert not out.exists() or versions(out) == []  # refused before exporting
    # It quoted the training run's error: "Writing TensorBoard the log directory to ...
    # failed, so training stopped (...on_save_error=raise) ... resume from the latest
    # checkpoint": garbled, and about training, not this export.
    error = capsys.readouterr().err
    assert "export's TensorBoard card" in error and "writable directory" in error
    assert "Received: NotADirectoryError" in error
    for wrong in ("Writing TensorBoard the", "training stopped", "resume", "on_save_error"):
        assert wrong not in error, error
