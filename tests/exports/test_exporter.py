"""Serving exports: versions, atomic publication, warmup requests, exports from checkpoints
of every backend, links back to TensorBoard, and the export / runs / inspect commands."""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from tests.helpers.tb_runs import assert_close, make_run
from trainer.cli.app import main
from trainer.exports.exporter import (
    ExportError,
    export_serving,
    read_export_metadata,
    versions,
)
from trainer.exports.sources import export_from_checkpoint
from trainer.exports.warmup import EXTRA_DIR, WARMUP_FILE
from trainer.model_state.serving import saved_model_signatures
from trainer.tensorboard.links import event_steps, resolve_link


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    return make_run(outputs / "run0", backends=("h5", "weights", "savedmodel"), epochs=3)


def read_warmup(version_dir):
    """The warmup requests of an export as ``[{input name: array}, ...]``."""
    path = version_dir / EXTRA_DIR / WARMUP_FILE
    requests = []
    for raw in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
        inputs = prediction_log_pb2.PredictionLog.FromString(raw).predict_log.request.inputs
        requests.append({k: tf.make_ndarray(v) for k, v in inputs.items()})
    return requests


def serve(version_dir, x):
    """Outputs of the export's ``serving_default`` on ``x``, through plain TensorFlow."""
    loaded = tf.saved_model.load(str(version_dir))
    signature = loaded.signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    (output,) = signature(**{name: tf.constant(x)}).values()
    return output.numpy()


def test_versions_are_published_whole_increase_and_are_pruned(run, tmp_path):
    model, x = run["model"], run["data"].x_val
    root = tmp_path / "export"
    seen: set[str] = set()
    incomplete: list[str] = []
    done = threading.Event()

    def watch():  # what a model server polling export/ sees
        while not done.is_set():
            for version in versions(root):
                path = root / str(version)
                if (
                    not (
                        (path / "saved_model.pb").is_file()
                        and (path / "variables" / "variables.index").is_file()
                        and (path / "assets.extra" / "trainer_export.json").is_file()
                    )
                    and path.exists()
                ):
                    incomplete.append(path.name)
                seen.add(path.name)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        paths = [export_serving(model, root, keep=2, format="keras") for _ in range(3)]
    finally:
        done.set()
        watcher.join()
    assert [p.name for p in paths] == ["1", "2", "3"]
    assert versions(root) == [2, 3]
    assert sorted(os.listdir(root)) == ["2", "3"]  # no temporaries left behind
    assert incomplete == [] and seen <= {"1", "2", "3"}

    meta = read_export_metadata(paths[-1])
    assert meta["version"] == 3 and meta["exported_with"] == "keras"
    assert meta["signatures"] == saved_model_signatures(paths[-1])
    signature = meta["signatures"]["serving_default"]
    assert signature["inputs"]["inputs"] == {"shape": [None, 8, 8, 1], "dtype": "float32"}
    assert_close(serve(paths[-1], x), model.predict(x, verbose=0))


def test_auto_export_uses_the_savedmodel_backend_and_serves_the_same(run, tmp_path):
    model, x = run["model"], run["data"].x_val
    path = export_serving(model, tmp_path / "export", format="auto")
    assert read_export_metadata(path)["exported_with"] == "savedmodel"
    assert_close(serve(path, x), model.predict(x, verbose=0))


def test_warmup_requests_replay_to_the_model_outputs(run, tmp_path):
    model, x = run["model"], run["data"].x_val[:3]
    path = export_serving(model, tmp_path / "export", warmup=x, format="keras")
    assert read_export_metadata(path)["warmup_requests"] == 3
    raw = list(
        tf.data.TFRecordDataset(
            str(path / "assets.extra" / "tf_serving_warmup_requests")
        ).as_numpy_iterator()
    )
    assert len(raw) == 3
    for i, record in enumerate(raw):
        request = prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
        assert request.model_spec.signature_name == "serving_default"
        (name,) = request.inputs
        inputs = tf.make_ndarray(request.inputs[name])
        np.testing.assert_array_equal(inputs, x[i : i + 1])
        assert_close(serve(path, inputs), model.predict(x[i : i + 1], verbose=0))
    assert [r["inputs"].shape for r in read_warmup(path)] == [(1, 8, 8, 1)] * 3


def test_a_failed_export_leaves_no_version_and_no_temporary(run, tmp_path):
    root = tmp_path / "export"
    export_serving(run["model"], root, format="keras")
    with pytest.raises(ExportError, match="exactly the signature inputs"):
        export_serving(run["model"], root, warmup={"wrong": run["data"].x_val}, format="keras")
    assert sorted(os.listdir(root)) == ["1"]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["h5", "weights", "savedmodel"])
def test_export_from_any_backend_links_back_to_the_run(run, tmp_path, index):
    saved = run["checkpoints"][index]
    out = tmp_path / "served"
    path = export_from_checkpoint(saved["path"], out, format="keras")
    assert_close(serve(path, run["data"].x_val), saved["predictions"])

    meta = read_export_metadata(path)
    assert meta["source"]["backend"] == saved["backend"]
    assert meta["state"]["global_step"] == saved["step"]
    assert meta["state"]["epoch"] == saved["epoch"]
    assert "tensorboard" not in meta  # the source run is only read: no card unless asked
    link = meta["checkpoint_tensorboard"]  # the checkpoint's own link, kept
    assert link["step"] == saved["step"] and link["tag"] == f"checkpoints/{saved['path'].name}"
    assert link["run_name"] == "run0/tb" and link["log_dir"] == "tb"
    resolved = resolve_link(meta["source"]["checkpoint"], link)
    assert resolved.event_file.is_file()
    assert resolved.event_file.parent == run["run_dir"] / "tb"
    assert link["tag"] in event_steps(resolved.event_file)[saved["step"]]


def test_cli_export_runs_and_inspect(run, tmp_path, capsys):
    outputs = run["run_dir"].parent
    h5 = run["checkpoints"][0]["path"]
    export_root = run["run_dir"] / "export"
    warmup = 2
    tb = str(run["run_dir"] / "tb")  # the card goes into the run's log only when asked
    argv = ["export", str(h5), str(export_root), "--warmup", str(warmup), "--tensorboard", tb]
    assert main([*argv, "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    version_dir = export_root / str(exported["version"])
    assert exported["warmup_requests"] == warmup
    assert (
        resolve_link(version_dir, read_export_metadata(version_dir)).step
        == run["checkpoints"][0]["step"]
    )

    assert main(["runs", str(outputs), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    (listed,) = [r for r in listing["runs"] if r["name"] == "run0"]
    assert listed["tensorboard"]["run"] == "run0/tb"
    by_name = {c["name"]: c for c in listed["checkpoints"]}
    for saved in run["checkpoints"]:
        entry = by_name[saved["path"].name]
        assert entry["backend"] == saved["backend"]
        assert (entry["step"], entry["epoch"]) == (saved["step"], saved["epoch"])
        assert entry["metrics"] == pytest.approx(saved["metrics"])
        assert entry["read"] == "metadata"  # no model was loaded to list it
        assert entry["tensorboard"]["resolves"] is True
        assert entry["tensorboard"]["run"] == "run0/tb"
    (export_entry,) = [e for e in listed["exports"] if e["name"] == version_dir.name]
    assert export_entry["step"] == run["checkpoints"][0]["step"]
    assert export_entry["source_checkpoint"] == str(h5)
    assert export_entry["tensorboard"]["resolves"] is True

    assert main(["runs", str(outputs)]) == 0
    text = capsys.readouterr().out
    assert "run run0  (TensorBoard run: run0/tb)" in text and "BROKEN" not in text

    assert main(["inspect", str(version_dir)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"serving_default\(\w+: float32\[\?,8,8,1\]\) -> \w+: float32\[\?,3\]", text)
    assert "tensorboard:    run run0/tb step" in text and f"warmup:         {warmup}" in text

    assert main(["inspect", str(h5), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensorboard"]["resolves"] is True
    assert report["signatures"]["serving_default"]["outputs"]["output_0"]["shape"] == [None, 3]


def test_cli_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys):
    cases = [
        ["export", str(tmp_path / "missing.h5"), str(tmp_path / "out")],
        ["runs", str(tmp_path / "missing")],
        ["export", str(run["checkpoints"][0]["path"]), str(tmp_path / "o"), "--keep", "0"],
    ]
    (tmp_path / "not-a-model").mkdir()
    cases.append(["export", str(tmp_path / "not-a-model"), str(tmp_path / "out")])
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
