"""Exports never write into sealed directories nor delete what is not theirs, and their
signatures keep every output (found by a fidelity probe of exports and serving)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.cli.app import main
from trainer.errors import ExportError
from trainer.exports.exporter import export_serving, read_export_metadata, versions
from trainer.exports.sources import check_export_options, export_from_checkpoint
from trainer.save_backends import get_backend


def _model() -> keras.Model:
    inputs = keras.Input((3,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(inputs))
    model.compile(optimizer="adam", loss="mse")
    return model


def test_numbered_directories_that_are_not_exports_are_never_pruned(tmp_path):
    root = tmp_path / "out"
    for number in range(1, 4):  # a user's own numbered folders
        (root / str(number)).mkdir(parents=True)
        (root / str(number) / "notes.txt").write_text("mine")
    model = _model()
    made = [export_serving(model, root, keep=1, format="keras") for _ in range(2)]
    assert [p.name for p in made] == ["4", "5"]
    assert versions(root) == [1, 2, 3, 5]  # the older export went, the user's stayed
    assert all((root / str(n) / "notes.txt").read_text() == "mine" for n in (1, 2, 3))


def test_an_export_root_inside_a_checkpoint_or_an_export_or_a_file_is_refused(tmp_path):
    model = _model()
    checkpoint = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    export = export_serving(model, tmp_path / "export", format="keras")
    (tmp_path / "file").write_text("x")
    for root, what in [
        (checkpoint, "inside a checkpoint"),
        (checkpoint / "variables" / "more", "inside a checkpoint"),
        (export, "inside an export"),
        (tmp_path / "file", "is a file"),
    ]:
        with pytest.raises(ExportError, match=what):
            export_serving(model, root, format="keras")
    assert get_backend("savedmodel").check_integrity(checkpoint, digests=True, strict=True)
    assert not (checkpoint / "1").exists() and not (export / "1").exists()
    assert main(["export", str(checkpoint), str(checkpoint)]) == 2


def test_warmup_counts_below_zero_are_refused(tmp_path):
    checkpoint = get_backend("h5").save(_model(), tmp_path / "ckpt")
    with pytest.raises(ExportError, match="at least 0"):
        export_from_checkpoint(checkpoint, tmp_path / "out", warmup=-1)
    for options, key in [
        ({"warmup_examples": -1}, "export.warmup_examples"),
        ({"keep": 0}, "export.keep"),
        ({"format": "onnx"}, "export.format"),
    ]:
        with pytest.raises(ExportError, match=key):
            check_export_options(options)
    check_export_options({"warmup_examples": 0, "keep": 1, "format": "keras"})
    assert not (tmp_path / "out").exists()


def test_the_source_of_an_export_of_latest_is_the_checkpoint_it_points_to(tmp_path):
    checkpoint = get_backend("h5").save(_model(), tmp_path / "step-1")
    (tmp_path / "latest").symlink_to(checkpoint.name)
    path = export_from_checkpoint(tmp_path / "latest", tmp_path / "out", format="keras")
    assert read_export_metadata(path)["source"]["checkpoint"] == str(checkpoint.resolve())


def _serve(directory, x) -> dict[str, np.ndarray]:
    signature = tf.saved_model.load(str(directory)).signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    return {k: v.numpy() for k, v in signature(**{name: tf.constant(x)}).items()}


@pytest.mark.parametrize("shape", ["colliding_keys", "nested_dict"])
def test_every_output_is_in_the_serving_signature(tmp_path, shape):
    """``a-b`` and ``a_b`` became one signature key (one output dropped, silently); a dict
    entry holding a list could not be saved at all (a raw TensorFlow error)."""
    inputs = keras.Input((3,), name="x")
    one, two = keras.layers.Dense(1)(inputs), keras.layers.Dense(2)(inputs)
    if shape == "colliding_keys":
        outputs = {"a-b": one, "a_b": two}
    else:
        outputs = {"a": [one, two], "b": keras.layers.Dense(4)(inputs)}
    model = keras.Model(inputs, outputs)
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    served = _serve(get_backend("savedmodel").save(model, tmp_path / "ckpt"), x)
    expected = keras.tree.flatten(model.predict(x, verbose=0))
    assert len(served) == len(expected)
    got = sorted(served.values(), key=lambda a: (a.shape[1], float(a.sum())))
    want = sorted(expected, key=lambda a: (a.shape[1], float(a.sum())))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@keras.saving.register_keras_serializable(package="test_export_guards")
class TwoLayerNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def _subclassed() -> tuple[keras.Model, np.ndarray]:
    model = TwoLayerNet()
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    model(x)
    model.compile(optimizer="adam", loss="mse")
    return model, x


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_a_subclassed_model_rebuilt_from_its_config_exports(tmp_path, backend):
    """Rebuilt from its config, the model is built but was never called: the export (CLI
    and API) refused it, saying to call it, although the same checkpoint loaded and
    predicted. Its input signature is the one Keras recorded when it was built."""
    model, x = _subclassed()
    checkpoint = get_backend(backend).save(model, tmp_path / "ckpt")
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    (served,) = _serve(tmp_path / "out" / "1", x).values()
    np.testing.assert_allclose(served, model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_a_subclassed_model_revived_from_its_traces_exports(tmp_path):
    from tests.helpers.savedmodel_zoo import classes_hidden
    from trainer.save_backends import load_checkpoint

    model, x = _subclassed()
    checkpoint = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["TwoLayerNet"], "test_export_guards"):
        revived = load_checkpoint(checkpoint).model
        assert not isinstance(revived, TwoLayerNet)
        path = export_serving(revived, tmp_path / "out")
    (served,) = _serve(path, x).values()
    np.testing.assert_allclose(served, model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def _input_keys(directory) -> list[str]:
    signature = tf.saved_model.load(str(directory)).signatures["serving_default"]
    return sorted(signature.structured_input_signature[1])


def test_an_unnamed_input_has_one_key_in_every_artifact_of_the_model(tmp_path):
    """The key was the input tensor's counter name (keras_tensor_47), another for the
    train-end export, the checkpoints and an export of a checkpoint: clients broke. It is
    the input layer's name, which the config stores."""
    from trainer.checkpointing import CheckpointManager, CheckpointPolicy

    keras.Input((3,))  # moves Keras's counters: names differ from a fresh process's
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss="mse")
    layer_name = model.layers[0].name
    policy = CheckpointPolicy(async_save=True)
    with CheckpointManager(tmp_path / "ckpt", backend="savedmodel", policy=policy) as manager:
        manager.save(model)
        manager.wait()
        checkpoint = manager.latest()
    keys = {
        "checkpoint (async copy)": _input_keys(checkpoint),
        "sync checkpoint": _input_keys(get_backend("savedmodel").save(model, tmp_path / "s")),
        "export": _input_keys(export_serving(model, tmp_path / "e")),
        "keras export": _input_keys(export_serving(model, tmp_path / "k", format="keras")),
        "export of the checkpoint": _input_keys(export_from_checkpoint(checkpoint, tmp_path / "c")),
    }
    assert all(value == [layer_name] for value in keys.values()), keys


def test_a_dict_input_model_exports_in_keras_format_and_warms_up_on_strings(tmp_path):
    """A Functional model on a dict of inputs: its keras-format export was given a flat
    list (a raw Keras error, exit 1 from the CLI); warmup examples of a string input
    raised a raw TypeError (NumPy has no dtype "string")."""
    inputs = {"z": keras.Input((3,), name="a"), "y": keras.Input((3,), name="b")}
    joined = keras.layers.Concatenate()([inputs["z"], inputs["y"]])
    model = keras.Model(inputs, keras.layers.Dense(1)(joined))
    x = {k: np.random.default_rng(0).normal(size=(4, 3)).astype("float32") for k in inputs}
    path = export_serving(model, tmp_path / "dict", format="keras")
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    assert sorted(signature.structured_input_signature[1]) == ["a", "b"]
    (served,) = signature(a=tf.constant(x["z"]), b=tf.constant(x["y"])).values()
    np.testing.assert_allclose(served.numpy(), model.predict(x, verbose=0), rtol=1e-6)

    text = keras.Input((), dtype="string", name="text")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"], output_mode="one_hot")
    strings = keras.Model(text, lookup(text))
    for examples in (np.array(["a", "q"]), ["b", "a"], tf.constant(["a", "b"])):
        warmed = export_serving(strings, tmp_path / "text", warmup=examples, format="keras")
        assert read_export_metadata(warmed)["warmup_requests"] == 2


def test_export_options_that_fail_only_after_training_are_refused_at_the_start():
    """Found by a probe: ``export.directory=checkpoints`` trained and then made the run
    impossible to resume (a resume took the export for the newest checkpoint);
    ``format=keras`` with ``with_optimizer=true`` trained the whole run, then failed."""
    for directory in ("checkpoints", "./checkpoints/served", "."):
        with pytest.raises(ExportError, match=r"export\.directory"):
            check_export_options({"directory": directory}, checkpoint_directory="checkpoints")
    check_export_options({"directory": "export"}, checkpoint_directory="checkpoints")
    check_export_options({"directory": "checkpoints2"}, checkpoint_directory="checkpoints")
    with pytest.raises(ExportError, match="with_optimizer"):
        check_export_options({"format": "keras", "with_optimizer": True})


def test_train_refuses_an_export_directory_among_its_checkpoints(compose_cfg, tmp_path):
    from trainer import train

    cfg = compose_cfg("model=mlp", "save=h5", "export.enabled=true", "export.directory=checkpoints")
    with pytest.raises(ExportError, match=r"export\.directory"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_warmup_writes_every_request_asked_for_up_to_tf_servings_limit(
    compose_cfg, tmp_path, capsys
):
    """``--warmup 150`` wrote 100 requests (a silent cap); TF Serving loads up to 1000, and
    refuses a version with more, so more is refused before anything is loaded or written."""
    from trainer import train
    from trainer.exports.warmup import count_warmup

    train(compose_cfg("model=mlp", "save=h5", "data.num_examples=1000", "trainer.epochs=1"))
    latest = tmp_path / "run" / "checkpoints" / "latest"
    assert main(["export", str(latest), str(tmp_path / "out"), "--warmup", "150"]) == 0
    assert "warmup requests: 150" in capsys.readouterr().out
    assert count_warmup(tmp_path / "out" / "1") == 150
    assert read_export_metadata(tmp_path / "out" / "1")["warmup_requests"] == 150

    assert main(["export", str(latest), str(tmp_path / "more"), "--warmup", "1001"]) == 2
    error = capsys.readouterr().err
    assert "TF Serving" in error and "1000" in error and error.rstrip().endswith("Received: 1001")
    with pytest.raises(ExportError, match=r"export\.warmup_examples .* 1000"):
        check_export_options({"warmup_examples": 1001})
    model = _model()
    with pytest.raises(ExportError, match="Received: 1001"):
        export_serving(model, tmp_path / "array", warmup=np.zeros((1001, 3), "float32"))
    assert not (tmp_path / "more").exists() and versions(tmp_path / "array") == []
    path = export_serving(model, tmp_path / "array", warmup=np.zeros((120, 3), "float32"))
    assert count_warmup(path) == 120
