"""Checkpoints as untrusted input: safe mode never runs stored code, and fuzzed metadata
yields a model or a project error, nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers.fault_corpus import BACKENDS, build_model, copy_checkpoint, reseal, save_all
from trainer.errors import TrainerError, UnsafeCheckpointError
from trainer.save_backends import get_backend, load_checkpoint


# ----------------------------------------------------------------------- safe mode
def lambda_model(marker: Path) -> keras.Model:
    """A Lambda whose marshalled bytecode leaves ``marker`` behind whenever it runs."""
    where = str(marker)
    inputs = keras.Input((4,))
    touched = keras.layers.Lambda(lambda x: (open(where, "a").close(), x * 2.0)[1])(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(touched))
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_safe_mode_never_runs_lambda_bytecode(tmp_path, backend):
    marker = tmp_path / "code-ran"
    model = lambda_model(marker)
    path = get_backend(backend).save(model, tmp_path / "lambda")
    marker.unlink(missing_ok=True)  # building and saving called the lambda
    if backend == "savedmodel":
        # Craft the record so the reviver believes the config carries no code and tries it.
        meta_file = path / "assets.extra" / "trainer_metadata.json"
        meta = json.loads(meta_file.read_text())
        for record in meta["savedmodel"]["layers"]:
            record["carries_code"] = False
        meta_file.write_text(json.dumps(meta))
        reseal(path)
        # Keras' safe mode refuses the bytecode; the layer is revived from its traced graph.
        revived = load_checkpoint(path).model
        x = np.ones((1, 4), "float32")
        np.testing.assert_allclose(revived(x), model(x), rtol=1e-6)
        marker.unlink(missing_ok=True)  # model(x) above ran the original, in this process
        load_checkpoint(path)
    else:
        with pytest.raises(UnsafeCheckpointError, match="safe_mode=False"):
            load_checkpoint(path)
    assert not marker.exists(), "stored Python code ran in safe mode"
    loaded = load_checkpoint(path, safe_mode=False).model  # the user vouches for the source
    assert marker.exists(), "safe_mode=False should rebuild the Lambda from its code"
    assert isinstance(loaded, keras.Model)


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_the_cli_refusal_of_a_lambda_names_a_call_the_user_can_run(tmp_path, capsys, backend):
    """The CLI's refusal said "load with safe_mode=False", which no command has: it names
    the Python call doing what the command did, and that call works."""
    from tests.helpers.processes import subprocess_env
    from trainer.cli.app import main
    from trainer.exports.exporter import versions

    marker = tmp_path / "code-ran"
    path = get_backend(backend).save(lambda_model(marker), tmp_path / "lambda")
    marker.unlink(missing_ok=True)
    out = tmp_path / "served"
    assert main(["export", str(path), str(out), "--keep", "2"]) == 2
    error = capsys.readouterr().err
    assert "load with safe_mode=False" not in error and "CLI never runs code" in error
    call = re.search(r'python -c "([^"]+)"', error).group(1)
    assert f"export_from_checkpoint({str(path)!r}, {str(out)!r}, keep=2, safe_mode=False)" in call
    assert error.rstrip().startswith("error: ") and "Received: Requested the" in error
    assert main(["inspect", str(path)]) == 2
    inspect_error = capsys.readouterr().err
    assert f"load_checkpoint({str(path)!r}, safe_mode=False)" in inspect_error
    assert not marker.exists() and not out.exists()

    done = subprocess.run(
        [sys.executable, "-c", call], env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert versions(out) == [1] and marker.exists()  # the user's call ran the lambda


# -------------------------------------------------------------------------- fuzzing
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.sampled_from([2**31, -(2**63), 10**30])
    | st.floats()
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
MUTATION = st.tuples(st.integers(0, 10**6), st.one_of(st.just("delete"), JSON))


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    return save_all(build_model(), tmp_path_factory.mktemp("fuzz"))


def documents(backend: str, path: Path) -> tuple[dict, callable]:
    """The stored JSON of a checkpoint as one dict, and a function writing it back."""
    if backend == "h5":
        names = ("metadata", "model_config", "compile_config", "training_state")
        with h5py.File(path, "r") as handle:
            doc = {n: json.loads(handle[n].asstr()[()]) for n in names}

        def write(new):
            with h5py.File(path, "r+") as handle:
                for name in names:
                    del handle[name]
                    if name in new:
                        text = json.dumps(new[name])
                        handle.create_dataset(name, data=text, dtype=h5py.string_dtype())

        return doc, write
    file = path / ("trainer.json" if backend == "weights" else "assets.extra/trainer_metadata.json")
    return json.loads(file.read_text()), lambda new: file.write_text(json.dumps(new))


def mutate(doc, index: int, replacement) -> None:
    """Replace (or delete) the ``index``-th node of ``doc`` in a stable walk order."""
    nodes = []
    stack = [doc]
    while stack:
        parent = stack.pop()
        keys = sorted(parent) if isinstance(parent, dict) else range(len(parent))
        for key in keys:
            nodes.append((parent, key))
            if isinstance(parent[key], dict | list):
                stack.append(parent[key])
    parent, key = nodes[index % len(nodes)]
    if replacement == "delete":
        del parent[key]
    else:
        parent[key] = replacement


def fuzz_backend(backend: str, original: Path, mutations) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = copy_checkpoint(original, Path(scratch))
        doc, write = documents(backend, path)
        for index, replacement in mutations:
            mutate(doc, index, replacement)
        write(doc)
        reseal(path)  # the manifest agrees: only the readers stand between us and harm
        try:
            checkpoint = load_checkpoint(path)
        except TrainerError:
            return
        assert isinstance(checkpoint.model, keras.Model)


FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never fails by chance
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("backend", ["h5", "weights"])
@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
@example(mutations=[(0, None), (495, "delete")])  # Keras raised RuntimeError on weights
def test_fuzzed_metadata_gives_a_model_or_a_project_error(originals, backend, mutations):
    fuzz_backend(backend, originals[backend], mutations)


@settings(FUZZ, max_examples=25)
@given(mutations=st.lists(MUTATION, min_size=1, max_size=2))
def test_fuzzed_savedmodel_metadata_gives_a_model_or_a_project_error(originals, mutations):
    fuzz_backend("savedmodel", originals["savedmodel"], mutations)


# ----------------------------------------------------- config stored in a checkpoint
@pytest.mark.parametrize(
    "data",
    [
        {"_target_": "numpy.savetxt", "fname": "MARKER", "X": [1.0]},  # any callable
        {"_target_": "trainer.data.make_synthetic",  # a nested target, instantiated too
         "num_examples": {"_target_": "numpy.savetxt", "fname": "MARKER", "X": [1.0]}},
    ],
)  # fmt: skip
def test_export_warmup_never_calls_what_a_checkpoint_names(tmp_path, data):
    """`trainer export --warmup N` built its examples with hydra.utils.instantiate on the
    checkpoint's stored data config: a `_target_` there ran (numpy.savetxt wrote a file).
    Only trainer's own loaders, with plain arguments, are called now."""
    from trainer.errors import ExportError
    from trainer.exports.sources import export_from_checkpoint

    marker = tmp_path / "code-ran"
    data = json.loads(json.dumps(data).replace("MARKER", str(marker)))
    path = get_backend("weights").save(
        build_model(), tmp_path / "ckpt", metadata={"config": {"data": data}}
    )
    with pytest.raises(ExportError, match=r"only by trainer's own data loaders.*Received"):
        export_from_checkpoint(path, tmp_path / "out", warmup=2)
    assert not marker.exists(), "a callable named in the checkpoint ran"
    plain = {"_target_": "trainer.data.make_synthetic", "num_examples": 8, "image_size": 2}
    path = get_backend("weights").save(
        keras.Sequential([keras.Input((2, 2, 1)), keras.layers.Flatten(), keras.layers.Dense(3)]),
        tmp_path / "ok",
        metadata={"config": {"data": plain}},
    )
    from trainer.exports.exporter import read_export_metadata

    exported = export_from_checkpoint(path, tmp_path / "out2", warmup=2)
    assert read_export_metadata(exported)["warmup_requests"] == 2


@keras.saving.register_keras_serializable(package="test_untrusted")
class ElsewhereModel(keras.Model):
    """A subclassed model whose class the loading process will not have."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_training_a_safely_loaded_model_with_async_saves_runs_no_stored_code(tmp_path):
    """A model revived from traced functions (its class missing) returns the config its
    checkpoint stored. The async copy rebuilt the model from that config outside safe
    mode: a stored config edited into a graph holding a Lambda ran the Lambda's bytecode
    as soon as the loaded model was trained with async checkpointing. The copy is now made
    in safe mode (it cannot be here: the saves are synchronous, with a warning)."""
    from tests.helpers.savedmodel_zoo import classes_hidden
    from trainer.checkpointing import Checkpoint

    marker = tmp_path / "code-ran"
    model = ElsewhereModel()
    model(np.ones((1, 4), "float32"))
    model.compile("sgd", "mse")
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    graph = keras.saving.serialize_keras_object(lambda_model(marker))["config"]
    meta_file = path / "assets.extra" / "trainer_metadata.json"
    meta = json.loads(meta_file.read_text())
    root = meta["savedmodel"]["layers"][0]["keras_config"]["config"]
    root.update({key: graph[key] for key in ("layers", "input_layers", "output_layers")})
    meta_file.write_text(json.dumps(meta))
    reseal(path)
    marker.unlink(missing_ok=True)  # building the graph above called the lambda
    with classes_hidden(["ElsewhereModel"], "test_untrusted"):
        loaded = load_checkpoint(path).model
        x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
        saves = Checkpoint(tmp_path / "tuned", backend="savedmodel", async_save=True)
        loaded.fit(x, y, epochs=2, verbose=0, callbacks=[saves])
    assert not marker.exists(), "the async copy ran bytecode stored in the checkpoint"
    assert len(list((tmp_path / "tuned").glob("step-*"))) == 2


@pytest.mark.parametrize("name", ["../victim", "/abs/victim", ".hidden", "a/b", "", 7])
def test_a_stored_retention_record_naming_no_plain_entry_is_refused(tmp_path, name):
    """Retention deletes the checkpoints its records name, and a resumed manager adopts the
    records the checkpoint stored: `../victim` or an absolute path deleted a directory
    outside the checkpoint directory on the next save of the resumed run."""
    from trainer.checkpointing import CheckpointManager
    from trainer.errors import CorruptCheckpointError
    from trainer.state import TrainingState

    victim = tmp_path / "victim"
    victim.mkdir()
    record = {"name": name, "step": 0, "epoch": 0, "epoch_end": True, "monitor": None}
    state = {"epoch": 1, "step_in_epoch": 0, "global_step": 3, "checkpoints": [record]}
    with pytest.raises(ValueError, match="retention record"):
        TrainingState.from_dict(state)
    path = get_backend("weights").save(build_model(), tmp_path / "ckpt")
    index = json.loads((path / "trainer.json").read_text())
    index["training_state"] = state
    (path / "trainer.json").write_text(json.dumps(index))
    reseal(path)
    with pytest.raises(CorruptCheckpointError, match="not a plain entry"):
        load_checkpoint(path)
    manager = CheckpointManager(tmp_path / "checkpoints", "weights")
    by_hand = TrainingState(global_step=3, checkpoints=[record])
    with pytest.raises(CorruptCheckpointError, match="nothing outside it is ever deleted"):
        manager.adopt(by_hand)
    assert victim.is_dir()


def test_retention_records_with_wrong_field_types_are_refused():
    from trainer.state import TrainingState

    record = {"name": "step-1", "step": "1", "epoch": 0, "epoch_end": True, "monitor": None}
    with pytest.raises(ValueError, match="field 'step' must be an integer >= 0"):
        TrainingState.from_dict({"checkpoints": [record]})
    record.update(step=1, monitor="low")
    with pytest.raises(ValueError, match="'monitor' must be a number or null"):
        TrainingState.from_dict({"checkpoints": [record]})


def test_a_layer_record_id_is_never_joined_into_a_path_outside(tmp_path):
    """A savedmodel layer record's id names its vocabulary folder: an id edited into
    ``../../x`` read a vocabulary from outside the checkpoint, and the lookup layer mapped
    every token differently, even under verify=True (the files were all intact)."""
    from trainer.errors import CorruptCheckpointError

    inputs = keras.Input((1,), dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["a", "b", "c"])
    model = keras.Model(inputs, lookup(inputs))
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere" / "keras"
    elsewhere.mkdir(parents=True)
    (elsewhere / "vocabulary.json").write_text(json.dumps(["[UNK]", "c", "b", "a"]))
    meta_file = path / "assets.extra" / "trainer_metadata.json"
    meta = json.loads(meta_file.read_text())
    (record,) = [r for r in meta["savedmodel"]["layers"] if r["class_name"] == "StringLookup"]
    record["id"] = "../../../elsewhere/keras"
    meta_file.write_text(json.dumps(meta))
    reseal(path)
    with pytest.raises(CorruptCheckpointError, match=r"its id must be its position.*Received"):
        load_checkpoint(path, verify=True)
