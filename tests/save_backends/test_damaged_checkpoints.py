"""The fault corpus: every damaged, crafted or misplaced checkpoint gives its own
``TrainerError`` -- never a raw exception, never a model.

Each case damages a fresh copy of a real checkpoint of every backend. Content changes
made "behind the manifest's back" are resealed (``fault_corpus.edit``), so these cases
test the readers themselves, not just the manifest.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from tests.helpers.fault_corpus import (
    BACKENDS,
    build_model,
    copy_checkpoint,
    data_file,
    edit,
    edit_layer,
    flip_bytes,
    index_file,
    reseal,
    save_all,
    set_record,
    truncate,
)
from trainer.errors import (
    CorruptCheckpointError,
    IncompatibleFormatError,
    IntegrityError,
    MissingClassError,
    NotACheckpointError,
    TrainerError,
)
from trainer.save_backends import backend_class, get_backend, load_checkpoint
from trainer.storage import limits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_all(build_model(), tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def fresh(saved, tmp_path):
    """``fresh(backend)`` -> a private copy of that backend's checkpoint."""
    return lambda backend: copy_checkpoint(saved[backend], tmp_path)


def refused(path, error=TrainerError, match=None, **kwargs):
    """Load ``path`` expecting ``error``; returns it. A model coming back fails the test."""
    with pytest.raises(error, match=match) as info:
        load_checkpoint(path, **kwargs)
    assert str(path.name) in str(info.value) or "checkpoint" in str(info.value)
    return info.value


# --------------------------------------------------------------------- variable data
@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_variable_data_is_caught_by_the_size_check(fresh, backend):
    path = fresh(backend)
    truncate(data_file(backend, path))
    error = refused(path, IntegrityError, match="bytes instead of")
    assert error.file == data_file(backend, path).relative_to(path).as_posix() or (
        backend == "h5" and error.file == path.name
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_variable_data_behind_the_manifest_is_corrupt(fresh, backend):
    """A writer that sealed a short file: the reader itself refuses it."""
    path = fresh(backend)
    if backend == "h5":  # the payload lives in the file itself: drop an array instead
        with h5py.File(path, "r+") as handle:
            layers = handle["layers"]
            first = next(k for k in sorted(layers) if "00000" in layers[k]["arrays"])
            del layers[first]["arrays/00000"]
    else:
        truncate(data_file(backend, path), keep=0.6)
    reseal(path)
    refused(path, CorruptCheckpointError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flipped_bytes_are_caught_by_digests(fresh, backend):
    path = fresh(backend)
    flip_bytes(data_file(backend, path), 0.7)
    error = refused(path, IntegrityError, match="SHA-256")  # every load checks digests
    assert error.file is not None


# ---------------------------------------------------------------- index and metadata
@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_deleted_index_file_names_the_missing_file(fresh, backend):
    path = fresh(backend)
    index = index_file(backend, path)
    index.unlink()
    error = refused(path, IntegrityError, match="is missing")
    assert error.file == index.relative_to(path).as_posix()


def test_deleted_savedmodel_metadata_is_not_taken_for_a_plain_savedmodel(fresh):
    path = fresh("savedmodel")
    (path / "assets.extra" / "trainer_metadata.json").unlink()
    refused(path, IntegrityError, match="trainer_metadata.json")


@pytest.mark.parametrize("backend", BACKENDS)
def test_deleted_manifest_is_detected(fresh, backend):
    path = fresh(backend)
    if backend == "h5":  # strip the user block: what copying the HDF5 content would do
        data = path.read_bytes()
        path.write_bytes(data[512:])
    else:
        manifest = backend_class(backend).manifest_file
        (path / manifest).unlink()
    refused(path, IntegrityError, match="manifest")


def test_corrupted_saved_model_pb(fresh):
    path = fresh("savedmodel")
    pb = path / "saved_model.pb"
    flip_bytes(pb, 0.3, count=64)
    refused(path, IntegrityError, match="saved_model.pb")
    pb.write_bytes(os.urandom(pb.stat().st_size))  # garbage of the right size: the reader
    refused(path, CorruptCheckpointError, match="cannot be loaded as a SavedModel", verify=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "part, value",
    [
        ("metadata", ["a", "list"]),
        ("metadata", {"format_version": "1"}),
        ("state", {"epoch": "one"}),
        ("state", 17),
        ("architecture", "Dense"),
    ],
)
def test_metadata_with_wrong_types(fresh, backend, part, value):
    path = fresh(backend)
    edit(backend, path, part, lambda _old: value)
    refused(path, CorruptCheckpointError)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ["format_version", "state", "config"])
def test_metadata_with_missing_keys(fresh, backend, key):
    path = fresh(backend)
    if key == "config" and backend != "savedmodel":
        edit(backend, path, "architecture", lambda old: {"class_name": old["class_name"]})
    elif key == "config":
        edit(backend, path, "architecture", lambda old: [{"id": 0}])
    elif backend == "savedmodel" or key == "format_version":
        edit(backend, path, "metadata", lambda old: {k: v for k, v in old.items() if k != key})
    else:
        edit(backend, path, "state", lambda old: {})  # the state of h5/weights lives apart
        edit(backend, path, "metadata", lambda old: {**old, "state": None})
    refused(path, CorruptCheckpointError)


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_unknown_class_is_a_missing_class(fresh, backend):
    path = fresh(backend)

    def rename(item):
        item["class_name"] = "NoSuchLayer"
        item["registered_name"] = "ghost>NoSuchLayer"
        item["module"] = None

    edit_layer(backend, path, "hidden", rename)
    refused(path, MissingClassError, match="ghost>NoSuchLayer")


def test_unknown_class_in_place_of_an_untraced_keras_layer_is_refused(fresh):
    """Keras' own layers are saved without traced calls, since every load rebuilds them
    from their config. A record edited to name a class that exists nowhere has nothing to
    stand in for it: the load names the layer and the class instead of guessing. (Custom
    classes keep their traces and revive from them:
    tests/save_backends/savedmodel/test_zoo_round_trips.py.)"""
    path = fresh("savedmodel")
    ghost = {"class_name": "NoSuch", "registered_name": "ghost>NoSuch"}
    edit_layer("savedmodel", path, "hidden", lambda item: item.update(ghost))
    set_record("savedmodel", path, "hidden", module="ghost", **ghost)
    error = refused(path, MissingClassError, match="'hidden'.*no traced call function")
    assert "ghost>NoSuch" in str(error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_absurd_nesting_is_refused(fresh, backend):
    path = fresh(backend)
    deep: object = 1
    for _ in range(limits.MAX_DEPTH + 5):
        deep = [deep]
    edit_layer(backend, path, "hidden", lambda item: item["config"].update(units=deep))
    refused(path, CorruptCheckpointError, match="nests deeper")


def test_json_deeper_than_the_parser_can_go_is_corrupt(fresh):
    path = fresh("weights")
    (path / "trainer.json").write_text("[" * 200_000 + "]" * 200_000)
    reseal(path)
    refused(path, CorruptCheckpointError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_absurd_sizes_are_refused_before_allocating(fresh, backend):
    path = fresh(backend)
    edit_layer(backend, path, "hidden", lambda item: item["config"].update(units=10**12))
    if backend == "savedmodel":  # make sure the config is what gets used
        set_record(backend, path, "hidden", build_config={"input_shape": [None, 6]})
    refused(path, CorruptCheckpointError, match="units=1000000000000")


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_oversized_json_document_is_refused(fresh, backend, monkeypatch):
    path = fresh(backend)
    edit(backend, path, "metadata", lambda old: {**old, "padding": "x" * 5000})
    monkeypatch.setattr(limits, "MAX_JSON_BYTES", 4000)
    refused(path, CorruptCheckpointError, match="byte limit")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["../../escape", "a/b", "/etc/passwd"])
def test_layer_names_with_path_separators_are_refused(fresh, backend, name):
    path = fresh(backend)
    edit_layer(backend, path, "hidden", lambda item: item["config"].update(name=name))
    if backend == "savedmodel":
        set_record(backend, path, "hidden", name=name)
    # Keras refuses the name; the SavedModel reviver reports the graph it cannot rebuild.
    refused(path, CorruptCheckpointError, match="cannot contain")
    assert not (path.parent / "escape").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_named_dot_dot_is_only_a_label(fresh, saved, backend):
    """No file is ever named after a layer, so ``..`` is harmless: same weights."""
    path = fresh(backend)
    edit_layer(backend, path, "hidden", lambda item: item["config"].update(name=".."))
    if backend == "savedmodel":
        set_record(backend, path, "hidden", name="..")
    loaded = load_checkpoint(path).model
    original = load_checkpoint(saved[backend]).model
    assert ".." in [layer.name for layer in loaded.layers]
    for mine, theirs in zip(loaded.get_weights(), original.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_manifest_paths_outside_the_checkpoint_are_refused(fresh, backend, tmp_path):
    path = fresh(backend)
    manifest = path / backend_class(backend).manifest_file
    doc = json.loads(manifest.read_text())
    doc["files"].append({"path": "../outside", "size": 1, "sha256": "0" * 64})
    manifest.write_text(json.dumps(doc))
    (tmp_path / "outside").write_text("x")
    refused(path, IntegrityError, match="outside the checkpoint")


# ------------------------------------------------------------------------- versions
@pytest.mark.parametrize("backend", BACKENDS)
def test_future_format_version_is_refused(fresh, backend):
    path = fresh(backend)
    edit(backend, path, "metadata", lambda old: {**old, "format_version": 99})
    if backend == "weights":  # the index carries its own copy of the version
        index = json.loads((path / "trainer.json").read_text())
        (path / "trainer.json").write_text(json.dumps({**index, "format_version": 99}))
        reseal(path)
    refused(path, IncompatibleFormatError, match="format version 99.*Upgrade trainer")


@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_future_manifest_version_is_refused(fresh, backend):
    path = fresh(backend)
    manifest = path / backend_class(backend).manifest_file
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 7}))
    refused(path, IncompatibleFormatError, match="manifest version 7")


@pytest.mark.parametrize("backend", BACKENDS)
def test_older_supported_versions_load_and_unsupported_ones_are_refused(fresh, backend):
    path = fresh(backend)
    current = backend_class(backend).format_version
    newer = type("Newer", (backend_class(backend),), {"format_version": current + 1})
    assert newer().load(path).state.global_step == 2  # the older version is still read
    retired = type("Retired", (newer,), {"min_format_version": current + 1})
    with pytest.raises(IncompatibleFormatError, match="no longer reads"):
        retired().load(path)


@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_checkpoints_from_before_manifests_still_load(fresh, backend):
    """Written by trainer before manifests: no manifest and no integrity record."""
    path = fresh(backend)
    edit(backend, path, "metadata", lambda old: {k: v for k, v in old.items() if k != "integrity"})
    (path / backend_class(backend).manifest_file).unlink()
    assert load_checkpoint(path).state.global_step == 2


# ------------------------------------------------------------------- wrong places
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_directory(tmp_path, backend):
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", NotACheckpointError)
    with pytest.raises(NotACheckpointError):
        get_backend(backend).load(tmp_path / "empty")


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_where_a_directory_is_expected(fresh, tmp_path, backend):
    (tmp_path / "file").write_text("not a checkpoint")
    with pytest.raises(NotACheckpointError):
        get_backend(backend).load(tmp_path / "file")
    refused(tmp_path / "file" / "inside", NotACheckpointError, match="directory is expected")
    if backend == "savedmodel":  # inside a checkpoint: variables/ replaced by a file
        path = fresh(backend)
        for child in (path / "variables").iterdir():
            child.unlink()
        (path / "variables").rmdir()
        (path / "variables").write_text("")
        refused(path, IntegrityError, match="directory is expected")


@pytest.mark.parametrize("backend", BACKENDS)
def test_symlink_loops(fresh, tmp_path, backend):
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    refused(tmp_path / "loop_a", NotACheckpointError, match="loop")
    with pytest.raises(NotACheckpointError, match="loop"):
        get_backend(backend).load(tmp_path / "loop_a")
    if backend != "h5":  # inside a directory checkpoint: a file replaced by a loop
        path = fresh(backend)
        victim = data_file(backend, path)
        victim.unlink()
        victim.symlink_to(victim)
        refused(path, IntegrityError, match="loop|symbolic")


@pytest.mark.parametrize("writer", BACKENDS)
@pytest.mark.parametrize("reader", BACKENDS)
def test_checkpoint_of_one_backend_loaded_by_another(fresh, writer, reader):
    if writer == reader:
        pytest.skip("same backend")
    path = fresh(writer)
    with pytest.raises(NotACheckpointError, match=f"it is a '{writer}' checkpoint"):
        get_backend(reader).load(path)
