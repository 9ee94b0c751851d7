"""Layers whose own Keras saving methods lose state a checkpoint must keep.

LoRA: Keras's ``Dense`` / ``Embedding`` (and the other LoRA-capable layers) merge the
adapters into the kernel when saved and set them to zero when loaded. The outputs come back;
the fine-tuning does not (zero adapters get zero gradients), and a quantized kernel is
re-quantized with the adapters in it, so even the outputs change. Every backend stores such
a layer's variables as they are.

TF-IDF lookups: the savedmodel backend gave a rebuilt ``TextVectorization`` /
``StringLookup`` its vocabulary without the IDF weights, which Keras refuses; the load then
failed (or fell back to traced functions) with a "class not found" message.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.errors import IncompatibleFormatError
from trainer.model_state import layer_protocol
from trainer.save_backends import get_backend, load_checkpoint

BACKENDS = ("savedmodel", "h5", "weights")


def _lora_model(kind: str) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """A model trained a little, then with LoRA enabled on its first layer and fine-tuned
    (``int8``: quantized before LoRA), so that the adapters and Adam's slots are non-zero."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    if kind == "embedding":
        x = rng.integers(0, 20, size=(16, 7)).astype("int32")
        layers = [keras.layers.Embedding(20, 4), keras.layers.GlobalAveragePooling1D()]
        model = keras.Sequential([keras.Input((7,), dtype="int32"), *layers, keras.layers.Dense(1)])
    else:
        x = rng.normal(size=(16, 6)).astype("float32")
        layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        model = keras.Sequential([keras.Input((6,)), *layers])
    y = rng.normal(size=(16, 1)).astype("float32")
    model.compile("adam", "mse")
    for _ in range(3):
        model.train_on_batch(x, y)
    if kind == "int8":
        model.quantize("int8")
    model.layers[0].enable_lora(2)
    model.compile("adam", "mse")
    for _ in range(3):
        model.train_on_batch(x, y)
    return model, x, y


def _variables(model: keras.Model) -> list[np.ndarray]:
    """Every variable, the optimizer's included, in order (names may differ)."""
    return [np.array(v.numpy()) for v in [*model.variables, *model.optimizer.variables]]


class Trajectory:
    """What the original model holds and does from its save on: its variables, its
    predictions, three more training steps' losses and its variables after them. Recorded
    once, so that several loads can be compared with one original (training it moves it)."""

    def __init__(self, original: keras.Model, x: np.ndarray, y: np.ndarray):
        self.variables = _variables(original)
        self.prediction = original.predict(x, verbose=0)
        self.losses = [original.train_on_batch(x, y) for _ in range(3)]
        self.after = _variables(original)


def _assert_same_variables(want: list[np.ndarray], loaded: keras.Model) -> None:
    got = _variables(loaded)
    assert len(got) == len(want)
    paths = [v.path for v in [*loaded.variables, *loaded.optimizer.variables]]
    for w, g, path in zip(want, got, paths, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=path)


def _assert_same_and_trains_the_same(original: Trajectory, loaded, x, y) -> None:
    adapters = [v for v in loaded.layers[0].variables if "lora" in v.path]
    assert len(adapters) == 2 and all(np.any(v.numpy() != 0) for v in adapters)
    _assert_same_variables(original.variables, loaded)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), original.prediction)
    assert [loaded.train_on_batch(x, y) for _ in range(3)] == original.losses
    _assert_same_variables(original.after, loaded)


@pytest.fixture(scope="module", params=["dense", "embedding", "int8"])
def lora_saved(request, tmp_path_factory):
    """(paths by backend, trajectory, x, y): each kind's model built and fine-tuned once,
    saved through every backend, then its trajectory recorded; each backend's test loads
    its save and compares with that one original (building and fine-tuning it traces two
    training steps: most of a test's time)."""
    model, x, y = _lora_model(request.param)
    folder = tmp_path_factory.mktemp(f"lora-{request.param}")
    paths = {backend: get_backend(backend).save(model, folder / backend) for backend in BACKENDS}
    return paths, Trajectory(model, x, y), x, y


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_adapters_come_back_as_trained_and_keep_training(backend, lora_saved):
    paths, original, x, y = lora_saved
    loaded = load_checkpoint(paths[backend]).model
    _assert_same_and_trains_the_same(original, loaded, x, y)


@pytest.mark.parametrize("backend", ["savedmodel", "weights"])
def test_lora_adapters_survive_an_async_save(backend, tmp_path):
    """The background save's shadow gets the variables as they are, not the merged form."""
    model, x, y = _lora_model("dense")
    policy = CheckpointPolicy(async_save=True)
    with CheckpointManager(tmp_path / "ckpt", backend=backend, policy=policy) as manager:
        manager.save(model)
        manager.wait()
        path = manager.latest()
    original = Trajectory(model, x, y)
    _assert_same_and_trains_the_same(original, load_checkpoint(path).model, x, y)


def _as_older_trainer_saved(monkeypatch) -> None:
    """Save LoRA layers the way trainer did before: through Keras's merging methods."""
    monkeypatch.setattr(layer_protocol, "merges_lora_when_saved", lambda layer: False)
    monkeypatch.setattr(layer_protocol, "loads_own_variables_by_position", lambda layer: False)
    monkeypatch.setattr(layer_protocol, "lora_variable_arrays", lambda model: [])


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_an_older_checkpoint_holding_merged_lora_is_refused(backend, tmp_path, monkeypatch):
    model, _, _ = _lora_model("dense")
    with monkeypatch.context() as patch:
        _as_older_trainer_saved(patch)
        path = get_backend(backend).save(model, tmp_path / "ckpt")
    with pytest.raises(IncompatibleFormatError, match=r"LoRA enabled.*merged into the kernel"):
        load_checkpoint(path)


def test_an_older_savedmodel_holding_merged_lora_loads_its_variables(tmp_path, monkeypatch):
    """Its variables checkpoint always held the adapters as they were: those are used, and
    the merged copy in its layer-state file is left alone."""
    model, x, y = _lora_model("dense")
    with monkeypatch.context() as patch:
        _as_older_trainer_saved(patch)
        path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    assert (path / "assets.extra" / "trainer_layer_state.h5").is_file()
    _assert_same_and_trains_the_same(Trajectory(model, x, y), load_checkpoint(path).model, x, y)


TEXTS = np.array(["the cat sat", "the dog ran far", "a cat and a dog", "far far away"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.layers.TextVectorization(output_mode="tf_idf"),
        lambda: keras.layers.TextVectorization(ngrams=2, output_mode="tf_idf", max_tokens=12),
        lambda: keras.layers.StringLookup(output_mode="tf_idf"),
    ],
    ids=["text_vectorization", "text_vectorization_ngrams", "string_lookup"],
)
def test_tf_idf_lookups_load_from_their_class_through_savedmodel(make, tmp_path):
    keras.utils.set_random_seed(0)
    lookup = make()
    words = isinstance(lookup, keras.layers.StringLookup)
    data = np.array([t.split()[0] for t in TEXTS]) if words else TEXTS
    lookup.adapt(data)
    inputs = keras.Input((1,) if words else (), dtype="string")
    model = keras.Model(inputs, keras.layers.Dense(1)(lookup(inputs)))
    model.compile("adam", "mse")
    feed = tf.constant(data[:, None] if words else data)
    model.train_on_batch(feed, np.ones((4, 1), "float32"))
    checkpoint = load_checkpoint(get_backend("savedmodel").save(model, tmp_path / "ckpt"))
    assert checkpoint.metadata["revived_from"][lookup.name] == "config"
    np.testing.assert_array_equal(checkpoint.model(feed), model(feed))
    # Rebuilt from its class, it saves again with any backend (a stand-in could not).
    again = load_checkpoint(get_backend("h5").save(checkpoint.model, tmp_path / "again"))
    np.testing.assert_array_equal(again.model(feed), model(feed))
