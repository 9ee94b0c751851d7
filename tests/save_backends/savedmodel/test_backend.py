"""The SavedModel backend's directory is a real SavedModel; errors; trace-once saving;
safe mode; mixed precision and lookup-table assets."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import savedmodel_zoo as zoo
from trainer._compat import tensorflow as tf_compat
from trainer.errors import IntegrityError, ModelNotReadyError, NotACheckpointError
from trainer.save_backends import detect_backend, get_backend
from trainer.save_backends.savedmodel.layout import metadata_path
from trainer.save_backends.savedmodel.save import trace_cache
from trainer.storage import integrity


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    keras.utils.set_random_seed(3)
    model, x, _y, _ = zoo.two_in_two_out()
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("sm") / "ckpt")
    return model, x, path


def test_plain_tensorflow_process_serves_it(two_by_two, tmp_path):
    model, x, path = two_by_two
    expected = model.predict(x, verbose=0)
    np.save(tmp_path / "left.npy", x["left"])
    np.save(tmp_path / "right.npy", x["right"])
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, tensorflow as tf
        loaded = tf.saved_model.load({str(path)!r})
        fn = loaded.signatures["serving_default"]
        out = fn(left=tf.constant(np.load({str(tmp_path / "left.npy")!r})),
                 right=tf.constant(np.load({str(tmp_path / "right.npy")!r})))
        assert "trainer" not in sys.modules
        np.save({str(tmp_path / "value.npy")!r}, out["value"].numpy())
        np.save({str(tmp_path / "probs.npy")!r}, out["probs"].numpy())
        """
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ""}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
    for key in ("value", "probs"):
        got = np.load(tmp_path / f"{key}.npy")
        np.testing.assert_allclose(got, expected[key], atol=1e-5)


def test_tfsmlayer_and_saved_model_cli(two_by_two):
    model, x, path = two_by_two
    layer = keras.layers.TFSMLayer(str(path), call_endpoint="serving_default")
    out = layer(x)
    np.testing.assert_allclose(out["probs"], model.predict(x, verbose=0)["probs"], atol=1e-5)
    cli = shutil.which("saved_model_cli")
    if cli is None:
        pytest.skip("saved_model_cli is not on PATH")
    shown = subprocess.run(
        [cli, "show", "--dir", str(path), "--all"], capture_output=True, text=True, check=True
    ).stdout
    assert "serving_default" in shown
    for name in ("left", "right", "value", "probs"):
        assert f"['{name}']" in shown


def test_layout_and_metadata(two_by_two):
    _model, _x, path = two_by_two
    assert (path / "saved_model.pb").is_file()
    assert (path / "variables" / "variables.index").is_file()
    assert not list(path.rglob("*.keras")) and not list(path.rglob("*.h5"))
    meta = json.loads(metadata_path(path).read_text())
    assert meta["backend"] == "savedmodel" and meta["format_version"] == 2
    layers = meta["savedmodel"]["layers"]
    scale = next(r for r in layers if r["name"] == "scale_left")
    assert scale["registered_name"] == "smzoo>Scale"
    assert scale["functions"]["call_infer"] == "call_infer"
    assert all(v["node_id"] is not None for v in meta["savedmodel"]["variables"])
    assert meta["compile_config"]["loss"]["value"] == "mse"
    assert detect_backend(path).name == "savedmodel"


def test_repeat_save_reuses_the_trace_and_stays_complete(tmp_path):
    # new weights and optimizer state between the saves, the same structure
    backend, model, x, _y, first, second = zoo.saved_before_and_after_training(tmp_path, 4)
    meta = json.loads(metadata_path(second).read_text())
    assert json.loads(metadata_path(first).read_text())["full_save"] is True
    assert meta["full_save"] is False
    assert (first / "saved_model.pb").read_bytes() == (second / "saved_model.pb").read_bytes()
    # its fingerprint is the one TensorFlow computes for it (derived from the first's)
    fingerprint = tf.saved_model.experimental.read_fingerprint(str(second))
    copy = tmp_path / "refingerprinted"
    shutil.copytree(second, copy)
    (copy / "fingerprint.pb").unlink()
    tf_compat.write_fingerprint(str(copy))
    recomputed = tf.saved_model.experimental.read_fingerprint(str(copy))
    assert fingerprint.checkpoint_hash == recomputed.checkpoint_hash
    assert fingerprint.saved_model_checksum == recomputed.saved_model_checksum
    assert (
        fingerprint.checkpoint_hash
        != tf.saved_model.experimental.read_fingerprint(str(first)).checkpoint_hash
    )
    # the checkpoint written by tf.train.Checkpoint(root) restores under the SavedModel
    loaded = tf.saved_model.load(str(second))
    expected = [v.numpy() for v in trace_cache.cached(model).traced.root.model_variables]
    for got, want in zip(loaded.model_variables, expected, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
    revived = backend.load(second).model
    np.testing.assert_array_equal(revived.predict(x, verbose=0), model.predict(x, verbose=0))
    for a, b in zip(model.optimizer.variables, revived.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # a structural change is detected and triggers a full save
    model.get_layer("outer").trainable = False
    third = backend.save(model, tmp_path / "c")
    assert json.loads(metadata_path(third).read_text())["full_save"] is True


def test_unbuilt_model_is_refused_and_nothing_written(tmp_path):
    model = keras.Sequential([keras.layers.Dense(3, name="never_built")])
    with pytest.raises(ModelNotReadyError, match=r"never_built|not built"):
        get_backend("savedmodel").save(model, tmp_path / "x")
    assert not any(tmp_path.iterdir())


def test_unserializable_metadata_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ModelNotReadyError, match="caller metadata"):
        get_backend("savedmodel").save(model, tmp_path / "x", metadata={"obj": object()})
    assert not any(tmp_path.iterdir())


def test_plain_saved_model_is_pointed_to_tf_loaders(tmp_path):
    module = tf.Module()
    module.v = tf.Variable(1.0)
    module.f = tf.function(lambda x: x * module.v, input_signature=[tf.TensorSpec([], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "plain"))
    with pytest.raises(NotACheckpointError, match="TFSMLayer"):
        get_backend("savedmodel").load(tmp_path / "plain")


def test_lambda_is_traced_in_safe_mode_and_rebuilt_only_when_unsafe(tmp_path):
    keras.utils.set_random_seed(5)
    model, x, _y, _ = zoo.lambda_layer()
    path = get_backend("savedmodel").save(model, tmp_path / "l")
    safe = get_backend("savedmodel").load(path)
    assert safe.metadata["revived_from"]["affine"] == "traced"
    np.testing.assert_allclose(safe.model.predict(x, verbose=0), model.predict(x, verbose=0))
    # Still a Lambda (isinstance checks hold), running its trace, and saying so.
    revived = safe.model.get_layer("affine")
    assert isinstance(revived, keras.layers.Lambda)
    np.testing.assert_allclose(revived.function(x).numpy(), x * 2.0 + 1.0, rtol=1e-6)
    assert revived.get_config()["trainer_revived_from"] == "traced functions"
    with pytest.raises(ValueError, match="trainer_revived_from"):  # no Lambda passes for it
        keras.layers.Lambda.from_config(revived.get_config(), safe_mode=False)
    unsafe = get_backend("savedmodel").load(path, safe_mode=False)
    assert unsafe.metadata["revived_from"]["affine"] == "config"
    assert isinstance(unsafe.model.get_layer("affine"), keras.layers.Lambda)
    np.testing.assert_array_equal(unsafe.model.predict(x, verbose=0), model.predict(x, verbose=0))


def test_mixed_precision_model_round_trips(tmp_path):
    keras.utils.set_random_seed(6)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((6,))
        h = zoo.Scale(name="scale")(keras.layers.Dense(8, activation="relu")(inputs))
        out = keras.layers.Dense(2, dtype="float32")(h)
        model = keras.Model(inputs, out)
        x, y = zoo._data(), zoo._data(shape=(2,), seed=1)
        zoo._fit(model, x, y)
        path = get_backend("savedmodel").save(model, tmp_path / "mp")
    finally:
        keras.config.set_dtype_policy(previous)
    known = get_backend("savedmodel").load(path).model
    assert known.get_layer("scale").dtype_policy.name == "mixed_float16"
    np.testing.assert_array_equal(known.predict(x, verbose=0), model.predict(x, verbose=0))
    with zoo.classes_hidden(["Scale"]):
        missing = get_backend("savedmodel").load(path).model
        assert missing.get_layer("scale").dtype_policy.name == "mixed_float16"
        np.testing.assert_allclose(
            missing.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-3
        )
        missing.fit(x, y, epochs=1, verbose=0)


def test_string_lookup_vocabulary_travels_with_the_model(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("red\ngreen\nblue\n")
    inputs = keras.Input((1,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=str(vocab), name="lookup")(inputs)
    emb = keras.layers.Embedding(5, 3, name="emb")(ids)
    model = keras.Model(inputs, keras.layers.Flatten()(emb))
    model.compile("adam", "mse")
    x = tf.constant([["red"], ["blue"], ["pink"]])
    expected = model(x).numpy()
    path = get_backend("savedmodel").save(model, tmp_path / "lookup")
    vocab.unlink()  # the checkpoint must not depend on the original file
    revived = get_backend("savedmodel").load(path).model
    np.testing.assert_array_equal(revived(x).numpy(), expected)
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    np.testing.assert_allclose(next(iter(served(x).values())), expected)


def test_repeat_saves_manifest_holds_each_files_own_digest(tmp_path):
    """A repeat save gives the manifest the digests of the files it wrote from memory
    instead of reading them back. Each entry must still be the file's own digest, the
    lookup vocabulary included: rewritten by every save, here with other words of the
    same size."""
    inputs = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["red", "tan"], name="lookup")
    emb = keras.layers.Embedding(5, 3, name="emb")(lookup(inputs))
    model = keras.Model(inputs, keras.layers.Flatten()(emb))
    model.compile("adam", "mse")
    x, y = tf.constant([["red"], ["tan"]]), np.ones((2, 3), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    backend = get_backend("savedmodel")
    first = backend.save(model, tmp_path / "a")
    lookup.set_vocabulary(["red", "sky"])
    model.fit(x, y, epochs=1, verbose=0)
    second = backend.save(model, tmp_path / "b")
    assert json.loads(metadata_path(second).read_text())["full_save"] is False
    words = [p.relative_to(second) for p in second.rglob("vocabulary.json")]
    assert words and all((first / w).read_bytes() != (second / w).read_bytes() for w in words)
    for path in (first, second):
        manifest = integrity.read_manifest(path, backend.manifest_file)
        on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        assert sorted(e["path"] for e in manifest["files"]) == [
            f for f in on_disk if f != backend.manifest_file
        ]
        for entry in manifest["files"]:
            assert entry["sha256"] == integrity.file_digest(path / entry["path"]), entry
    assert backend.load(second, verify=True).model.get_layer("lookup").get_vocabulary()[1:] == [
        "red",
        "sky",
    ]


def test_repeat_saves_share_no_file_with_the_checkpoint_before(tmp_path):
    """A repeat save hard-linked ``saved_model.pb`` from the checkpoint published before it:
    truncating that file in one checkpoint damaged every kept checkpoint of the run
    (issue 36). Each save now writes its own copy; damage to one leaves the other whole."""
    backend, model, x, _y, first, second = zoo.saved_before_and_after_training(tmp_path, 4)
    third = backend.save(model, tmp_path / "c")
    inodes = [
        (f.stat().st_dev, f.stat().st_ino)
        for checkpoint in (first, second, third)
        for f in checkpoint.rglob("*")
        if f.is_file()
    ]
    assert len(inodes) == len(set(inodes))
    expected = model.predict(x, verbose=0)
    with open(third / "saved_model.pb", "r+b") as handle:
        handle.truncate(100)
    assert backend.check_integrity(second, digests=True, strict=True) is not None
    loaded = backend.load(second).model
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    with pytest.raises(IntegrityError, match=r"saved_model\.pb"):
        backend.load(third)


def test_a_traced_repeat_write_gives_the_fingerprint_tensorflow_computes(tmp_path):
    """The traced variables write hashes the index it wrote in the same call; the
    fingerprint made from that hash is the one TensorFlow computes for the directory."""
    backend, model, x, y, _first, second = zoo.saved_before_and_after_training(tmp_path, 6)
    assert backend.prepare_repeat_saves(model, tmp_path / "scratch")  # the write traced
    model.fit(x, y, epochs=1, verbose=0)
    third = backend.save(model, tmp_path / "third")
    copy = tmp_path / "refingerprinted"
    shutil.copytree(third, copy)
    (copy / "fingerprint.pb").unlink()
    tf_compat.write_fingerprint(str(copy))
    saved = tf.saved_model.experimental.read_fingerprint(str(third))
    recomputed = tf.saved_model.experimental.read_fingerprint(str(copy))
    assert saved.checkpoint_hash == recomputed.checkpoint_hash
    assert saved.checkpoint_hash != (
        tf.saved_model.experimental.read_fingerprint(str(second)).checkpoint_hash
    )
