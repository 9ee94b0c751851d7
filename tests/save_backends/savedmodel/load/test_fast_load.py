"""Issue 17: a savedmodel load whose every class is known reads the variables checkpoint and
never imports the traced functions; a load that needs them still does. Either way the
model must be the saved one: same outputs, same optimizer state, same next training step."""

from __future__ import annotations

import shutil

import keras
import numpy as np
import pytest

from trainer.errors import CorruptCheckpointError
from trainer.save_backends import get_backend

PACKAGE = "test_fast_load"


@keras.saving.register_keras_serializable(package=PACKAGE)
class Block(keras.layers.Layer):
    """A custom layer with sublayers (what a real model's own blocks look like)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.inner = keras.layers.Dense(width, activation="relu")
        self.norm = keras.layers.BatchNormalization()

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.norm.build((*input_shape[:-1], self.width))

    def call(self, x, training=None):
        return self.norm(self.inner(x), training=training) + x

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def _model() -> keras.Model:
    inputs = keras.Input((6,), name="features")
    x = Block(6, name="block_a")(inputs)
    x = keras.layers.Dropout(0.3, seed=1)(x)
    x = Block(6, name="block_b")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(8, 6)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


@pytest.fixture(scope="module")
def saved(save_trained):
    """Saved once for the module; tests that change the model or the files use copies."""
    return save_trained(_model, _data(0))


def _same_next_step(original: keras.Model, loaded: keras.Model) -> None:
    """One training step from the same state moves both models to the same weights."""
    x, y = _data(1)
    for model in (original, loaded):
        keras.utils.set_random_seed(7)  # same dropout mask in both
        model.train_on_batch(x, y)
    for a, b in zip(original.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)


def test_a_missing_class_loads_the_traced_functions(saved):
    original, path = saved
    key = f"{PACKAGE}>Block"
    objects = keras.saving.get_custom_objects()
    removed = objects.pop(key)
    try:
        checkpoint = get_backend("savedmodel").load(path)
    finally:
        objects[key] = removed
    assert checkpoint.metadata["traced_functions_loaded"] is True
    assert checkpoint.metadata["revived_from"]["block_a"] == "traced"
    x, _ = _data(2)
    np.testing.assert_allclose(
        checkpoint.model.predict(x, verbose=0), original.predict(x, verbose=0), atol=1e-5
    )


def test_variables_of_another_model_are_refused(saved, tmp_path):
    """The checkpoint's variables no longer fit the records (here: a smaller model's
    variables copied over): refused as damaged, never loaded with wrong values."""
    path = tmp_path / "copy"
    shutil.copytree(saved[1], path)
    inputs = keras.Input((6,))
    other = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    other.compile(optimizer="adam", loss="mse")
    other_path = get_backend("savedmodel").save(other, tmp_path / "other")
    for part in (path / "variables").iterdir():
        part.write_bytes((other_path / "variables" / part.name).read_bytes())
    with pytest.raises(CorruptCheckpointError):
        get_backend("savedmodel").load(path)


def test_classes_known_load_skips_the_traced_functions_and_is_exact(saved):
    """Last in the module: its training step changes the shared original."""
    original, path = saved
    checkpoint = get_backend("savedmodel").load(path)
    model = checkpoint.model
    assert checkpoint.metadata["traced_functions_loaded"] is False
    assert set(checkpoint.metadata["revived_from"].values()) <= {"config", "graph"}
    x, _ = _data(2)
    np.testing.assert_array_equal(model.predict(x, verbose=0), original.predict(x, verbose=0))
    for a, b in zip(original.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    assert int(model.optimizer.iterations.numpy()) == 4
    _same_next_step(original, model)


INITIALIZER_CALLS: list[tuple[int, ...]] = []


@keras.saving.register_keras_serializable(package=PACKAGE)
class CountedInitializer(keras.initializers.Initializer):
    """Random normal values, counting its calls (a load should not make any)."""

    def __call__(self, shape, dtype=None):
        INITIALIZER_CALLS.append(tuple(shape))
        return keras.random.normal(shape, dtype=dtype, seed=len(INITIALIZER_CALLS))


@pytest.fixture(scope="module")
def saved_counted(tmp_path_factory):
    """A model whose head draws its kernel from ``CountedInitializer``, saved once for
    both loads below (they differ only in what the load can import)."""
    inputs = keras.Input((6,))
    x = Block(6, name="block")(inputs)
    outputs = keras.layers.Dense(2, kernel_initializer=CountedInitializer(), name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse")
    model.fit(*_data(3), epochs=1, batch_size=4, verbose=0)
    return model, get_backend("savedmodel").save(model, tmp_path_factory.mktemp("c") / "ckpt")


@pytest.mark.parametrize("block_class", ["known", "missing"])
def test_a_load_does_not_run_the_initializers_its_values_replace(saved_counted, block_class):
    """Variables rebuilt from configs start without their random initial values (the stored
    values replace them at once); the loaded model is still exactly the saved one."""
    model, path = saved_counted
    INITIALIZER_CALLS.clear()
    objects = keras.saving.get_custom_objects()
    removed = objects.pop(f"{PACKAGE}>Block") if block_class == "missing" else None
    try:
        checkpoint = get_backend("savedmodel").load(path)
    finally:
        if removed is not None:
            objects[f"{PACKAGE}>Block"] = removed
    assert checkpoint.metadata["revived_from"]["head"] == "config"
    assert INITIALIZER_CALLS == []
    # Every value is the saved one, none left at zeros (paths may be renumbered: by position).
    for a, b in zip(model.weights, checkpoint.model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    x, _ = _data(4)  # the traced call of a missing class may round differently
    np.testing.assert_allclose(
        checkpoint.model.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5
    )
