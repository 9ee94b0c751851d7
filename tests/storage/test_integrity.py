"""Manifests: where they live, what they record, and ``python -m trainer verify``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import warm
from tests.helpers.fault_corpus import (
    BACKENDS,
    build_model,
    copy_checkpoint,
    data_file,
    flip_bytes,
    save_all,
)
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer.cli.app import main as cli_main
from trainer.errors import CorruptCheckpointError, IntegrityError
from trainer.save_backends import backend_class, load_checkpoint
from trainer.storage import integrity


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_all(build_model(), tmp_path_factory.mktemp("integrity"))


@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_directory_manifest_lists_every_other_file_with_size_and_digest(saved, backend):
    path = saved[backend]
    relative = backend_class(backend).manifest_file
    manifest = json.loads((path / relative).read_text())
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(e["path"] for e in manifest["files"]) == [f for f in files if f != relative]
    for entry in manifest["files"]:
        assert entry["size"] == (path / entry["path"]).stat().st_size
        assert entry["sha256"] == integrity.file_digest(path / entry["path"])
    assert manifest["backend"] == backend and manifest["version"] == integrity.VERSION


def test_savedmodel_manifest_keeps_the_directory_a_clean_savedmodel(saved):
    path = saved["savedmodel"]
    assert not (path / integrity.MANIFEST_FILE).exists()
    assert (path / "assets.extra" / integrity.MANIFEST_FILE).is_file()
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    assert served.structured_outputs  # TensorFlow alone still loads and serves it


def test_h5_manifest_is_the_user_block(saved):
    path = saved["h5"]
    header = integrity.read_hdf5_seal(path)
    assert header["size"] == path.stat().st_size
    assert header["sha256"] == integrity.bytes_digest(path.read_bytes()[512:])
    with h5py.File(path, "r") as handle:  # plain h5py skips the block
        assert handle.userblock_size == 512 and handle.attrs["format"] == "trainer-h5"


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_command_reports_ok_then_the_first_bad_file(saved, tmp_path, capsys, backend):
    path = copy_checkpoint(saved[backend], tmp_path)
    assert cli_main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "match their manifest" in out and "loads" in out
    bad = data_file(backend, path)
    flip_bytes(bad, 0.6)  # same size: only the digest can tell
    with pytest.raises(IntegrityError, match=f"{bad.name}.*SHA-256"):  # every load checks
        load_checkpoint(path)
    if backend == "savedmodel":  # TensorFlow's own CRC of the variables catches it too
        with pytest.raises(CorruptCheckpointError, match="Checksum does not match"):
            load_checkpoint(path, verify=False)
    else:  # verify=False (the opt-out) checks sizes only: h5 has no checksums of its own
        load_checkpoint(path, verify=False)
    assert cli_main(["verify", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and bad.name in err and "SHA-256" in err


def test_verify_reports_files_added_after_the_save(saved, tmp_path, capsys):
    path = copy_checkpoint(saved["weights"], tmp_path)
    (path / "stray.bin").write_bytes(b"x")
    assert cli_main(["verify", "--files-only", str(path)]) == 2
    assert "'stray.bin' is not in the manifest" in capsys.readouterr().err


def test_verify_as_a_command_exits_2_with_one_line(saved, tmp_path):
    path = copy_checkpoint(saved["savedmodel"], tmp_path)
    (path / "variables" / "variables.index").unlink()
    result = warm.run(
        [sys.executable, "-m", "trainer", "verify", str(path)],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "variables/variables.index' is missing" in lines[0]
    assert "Traceback" not in result.stderr


def test_verify_json_report(saved, capsys):
    assert cli_main(["verify", "--json", str(saved["h5"])]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "h5" and report["files"] == 1 and report["global_step"] == 2


def test_variables_hashed_beside_the_save_are_the_files_digests(tmp_path):
    """The variables' data is hashed in a thread while the save goes on (first and repeat
    saves): the manifest holds the digest of the bytes on disk, changed between saves."""
    from trainer.save_backends import get_backend

    model, backend = build_model(), get_backend("savedmodel")
    digests = []
    for name in ("first", "repeat"):
        path = backend.save(model, tmp_path / name)
        manifest = json.loads((path / backend.manifest_file).read_text())
        data = [e for e in manifest["files"] if e["path"].startswith("variables/variables.data")]
        assert data and all(e["sha256"] == integrity.file_digest(path / e["path"]) for e in data)
        digests.append(data[0]["sha256"])
        backend.check_integrity(path, digests=True, strict=True)
        for variable in model.trainable_variables:
            variable.assign(variable + 1.0)
    assert digests[0] != digests[1]


def test_a_digest_that_failed_in_its_thread_fails_the_manifest(tmp_path):
    pending = integrity.PendingDigest(tmp_path / "gone")
    with pytest.raises(FileNotFoundError):
        pending.result()
    (tmp_path / "gone").write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        integrity.build_manifest(tmp_path, "manifest.json", {"gone": pending})


@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_verify_reports_a_directory_link_added_after_the_save(saved, tmp_path, backend):
    """os.walk does not enter a linked directory: `assets_link -> /etc` passed verify."""
    path = copy_checkpoint(saved[backend], tmp_path / "copy")
    (path / "assets_link").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match=r"'assets_link' is a symbolic link"):
        backend_class(backend)().check_integrity(path, digests=True, strict=True)


def test_a_large_file_is_hashed_in_a_thread_and_a_small_one_at_once(tmp_path):
    large, small = tmp_path / "large", tmp_path / "small"
    large.write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    small.write_bytes(b"x" * 100)
    pending = integrity.PendingDigest(large)
    assert pending._thread is not None
    assert pending.result() == (2 << 20, integrity.file_digest(large))
    at_once = integrity.PendingDigest(small)
    assert at_once._thread is None and at_once.result() == (100, integrity.file_digest(small))


@pytest.mark.slow
def test_a_runs_checkpoints_and_export_share_no_file(compose_cfg):
    """Issue 36: consecutive savedmodel checkpoints shared ``saved_model.pb`` (a hard link),
    so truncating it in one damaged every kept checkpoint. No two files of a run's
    checkpoints and export may be one inode; damage to one checkpoint leaves the rest whole."""
    from trainer import train

    cfg = compose_cfg("save=savedmodel", "trainer.epochs=3", "export.enabled=true")
    train(cfg)
    run = Path(cfg.run_dir)
    files = [
        f for f in run.joinpath("checkpoints").rglob("*") if f.is_file() and not f.is_symlink()
    ]
    files += [f for f in run.joinpath("export").rglob("*") if f.is_file()]
    inodes = [(f.stat().st_dev, f.stat().st_ino) for f in files]
    assert len(files) > 20 and len(set(inodes)) == len(inodes)
    checkpoints = sorted(run.joinpath("checkpoints").glob("step-*"))
    assert len(checkpoints) == 3
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype("float32")
    before = [load_checkpoint(c).model.predict(x, verbose=0) for c in checkpoints]
    with open(checkpoints[-1] / "saved_model.pb", "r+b") as handle:
        handle.truncate(1000)
    for checkpoint, expected in zip(checkpoints[:-1], before, strict=False):
        assert cli_main(["verify", "--files-only", str(checkpoint)]) == 0
        np.testing.assert_array_equal(
            load_checkpoint(checkpoint).model.predict(x, verbose=0), expected
        )
    with pytest.raises(IntegrityError, match=r"saved_model\.pb"):
        load_checkpoint(checkpoints[-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_skips_a_damaged_newest_checkpoint(tmp_path, caplog, backend):
    """``CheckpointManager.restore()`` (and the Keras callback's resume="auto", through
    ``latest_whole``) continues from the newest checkpoint whose files are whole, naming
    the damaged one it skipped."""
    from trainer.checkpointing import CheckpointManager
    from trainer.state import TrainingState

    model = build_model()
    with CheckpointManager(tmp_path / "ckpt", backend) as manager:
        older = manager.save(model, TrainingState(epoch=1, global_step=4))
        newer = manager.save(model, TrainingState(epoch=2, global_step=8))
        manager.wait()
    flip_bytes(data_file(backend, newer), 0.5)
    manager = CheckpointManager(tmp_path / "ckpt", backend)
    # latest() reads metadata without digests, except h5's, read only after its digest.
    assert manager.latest() == (older if backend == "h5" else newer)
    with caplog.at_level("WARNING"):
        restored = manager.restore()
    assert restored.path == older and restored.state.global_step == 4
    assert f"Skipping damaged checkpoint {newer}" in caplog.text
