"""The round-trip contract every save backend must meet, as plain functions.

``tests/test_backends.py`` runs it over every registered backend; a user's own backend test
calls the same functions::

    from backend_suite import check_backend
    def test_my_backend(tmp_path):
        check_backend(MyBackend(), tmp_path)

Everything runs on CPU with op determinism on, so "identical" means bitwise identical.
"""

from __future__ import annotations

import copy
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.atomic import clean_stale_temporaries, is_temporary, temporary_sibling
from trainer.errors import ModelNotReadyError, NotACheckpointError, TrainerError
from trainer.save_backends import SaveBackend, available_backends, detect_backend, load_checkpoint
from trainer.state import TrainingState

SEED = 1234
BATCH = 8
FEATURES = 6
CLASSES = 3
MODEL_KINDS = ("sequential", "functional", "subclassed")


# ------------------------------------------------------------------ small real models
@keras.saving.register_keras_serializable(package="backend_suite")
class SuiteBlock(keras.layers.Layer):
    """A custom layer holding Dense/BatchNorm/Dense sublayers: layers within layers."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.layers.Dense(units, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.outer = keras.layers.Dense(units)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.norm.build((*input_shape[:-1], self.units))
        self.outer.build((*input_shape[:-1], self.units))

    def call(self, inputs, training=None):
        return self.outer(self.norm(self.inner(inputs), training=training))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="backend_suite")
class SuiteSubclassed(keras.Model):
    """A keras.Model subclass with its own ``call``; rebuilt from its build config."""

    def __init__(self, units: int = 12, num_classes: int = CLASSES, **kwargs):
        super().__init__(**kwargs)
        self.units, self.num_classes = units, num_classes
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.dropout = keras.layers.Dropout(0.3)
        self.head = keras.layers.Dense(num_classes)

    def call(self, inputs, training=None):
        return self.head(self.dropout(self.hidden(inputs), training=training))

    def get_config(self):
        return {"units": self.units, "num_classes": self.num_classes, "name": self.name}


def deterministic(seed: int = SEED) -> None:
    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()


def suite_data(kind: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(SEED)
    x = rng.normal(size=(4 * BATCH, FEATURES)).astype("float32")
    if kind == "sequential":  # regression head, compiled with plain strings
        return x, rng.normal(size=(len(x), CLASSES)).astype("float32")
    return x, rng.randint(0, CLASSES, size=len(x)).astype("int32")


def build_model(kind: str, *, compiled: bool = True) -> keras.Model:
    """A small built (and compiled) model of ``kind``; each compiles differently."""
    deterministic()
    if kind == "sequential":
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dropout(0.25),
                keras.layers.Dense(CLASSES),
            ]
        )
        # The case Keras 3's legacy .h5 cannot reload ("Could not deserialize keras.metrics.mse").
        compile_args = {"optimizer": "adam", "loss": "mse"}
    elif kind == "functional":
        inputs = keras.Input((FEATURES,))
        hidden = SuiteBlock(12)(inputs)
        hidden = keras.layers.Dropout(0.2)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
        compile_args = {
            "optimizer": keras.optimizers.SGD(0.05, momentum=0.9),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": ["accuracy"],
        }
    elif kind == "subclassed":
        model = SuiteSubclassed()
        model(np.zeros((1, FEATURES), "float32"))
        schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 4, 0.9)
        compile_args = {
            "optimizer": keras.optimizers.Adam(schedule),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": [keras.metrics.SparseCategoricalAccuracy()],
        }
    else:
        raise ValueError(f"Unknown model kind; valid: {MODEL_KINDS}. Received: {kind!r}")
    if compiled:
        model.compile(**compile_args)
    return model


def train(model: keras.Model, kind: str, epochs: int = 1) -> None:
    x, y = suite_data(kind)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def outputs(model: keras.Model, x: np.ndarray) -> np.ndarray:
    """Inference outputs from a direct call (no predict() tracing: the suite stays fast)."""
    return keras.ops.convert_to_numpy(model(x, training=False))


def all_values(model: keras.Model) -> list[np.ndarray]:
    """Every model variable (weights and RNG seed states) then every optimizer variable."""
    variables = list(model.variables)
    if getattr(model, "optimizer", None) is not None:
        variables += list(model.optimizer.variables)
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def assert_bitwise_equal(expected: list[np.ndarray], actual: list[np.ndarray], what: str):
    assert len(expected) == len(actual), f"{what}: {len(expected)} vs {len(actual)} variables"
    for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{index}]: dtype/shape differ"
        np.testing.assert_array_equal(a, b, err_msg=f"{what}[{index}] differs")


# ------------------------------------------------------------------------- checks
def check_round_trip(backend: SaveBackend, directory: Path, kind: str) -> None:
    """Save a trained ``kind`` model, load it, and require it to be the same model."""
    model = build_model(kind)
    train(model, kind, epochs=2)
    x, y = suite_data(kind)
    state = TrainingState(
        epoch=2, global_step=8, seed=SEED, metrics={"loss": 0.25}, extra={"suite": [1, 2]}
    )
    run_config = {"model": {"name": kind, "units": 12}, "trainer": {"epochs": 2}}
    path = backend.save(model, Path(directory) / f"ckpt-{kind}", state=state, metadata=run_config)
    assert path.exists() and not is_temporary(path), f"{backend.name} did not publish {path}"
    assert type(backend).can_load(path), f"{backend.name}.can_load rejects its own checkpoint"

    checkpoint = backend.load(path)
    loaded = checkpoint.model
    assert checkpoint.path == path
    assert checkpoint.state == state
    assert checkpoint.metadata["backend"] == backend.name
    assert checkpoint.metadata["format_version"] == backend.format_version
    assert checkpoint.metadata["keras_version"] == keras.__version__
    for key, value in run_config.items():
        assert checkpoint.metadata[key] == value, f"metadata[{key!r}] did not round-trip"

    np.testing.assert_array_equal(outputs(model, x), outputs(loaded, x))
    assert loaded.compiled and loaded.optimizer is not None, "model must come back compiled"
    assert type(loaded.optimizer) is type(model.optimizer)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 8
    assert_bitwise_equal(all_values(model), all_values(loaded), f"{kind} variables after load")
    expected = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert loaded.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True) == expected

    if available_backends().get(backend.name) is type(backend):
        assert detect_backend(path) is type(backend)
        detected = load_checkpoint(path)
        assert detected.state == state
        assert_bitwise_equal(all_values(loaded), all_values(detected.model), "auto-detected")

    # Continuing from the checkpoint is continuing from the model: Dropout masks, optimizer
    # slots, iteration count and learning-rate schedule position all came back.
    train(model, kind, epochs=1)
    train(loaded, kind, epochs=1)
    assert int(loaded.optimizer.iterations) == 12
    assert_bitwise_equal(all_values(model), all_values(loaded), f"{kind} after more training")


def check_unbuilt_model_rejected(backend: SaveBackend, directory: Path) -> None:
    """An unbuilt model raises ModelNotReadyError and leaves nothing on disk."""
    directory = Path(directory) / "unbuilt"
    directory.mkdir()
    for model in (keras.Sequential([keras.layers.Dense(2)]), SuiteSubclassed()):
        with pytest.raises(ModelNotReadyError, match="not built"):
            backend.save(model, directory / "never")
    assert list(directory.iterdir()) == []


def check_atomic_replace(backend: SaveBackend, directory: Path) -> None:
    """Saving over a checkpoint replaces it whole; a failed save leaves the old one intact."""
    directory = Path(directory) / "replace"
    model = build_model("sequential")
    x, _ = suite_data("sequential")
    path = backend.save(model, directory / "latest", state=TrainingState(epoch=1))
    train(model, "sequential")
    assert backend.save(model, directory / "latest", state=TrainingState(epoch=2)) == path
    second = outputs(model, x)
    assert [p.name for p in directory.iterdir()] == [path.name], "leftovers after replace"

    write = backend._write

    def crash_after_writing(model, tmp, state, metadata):
        write(model, tmp, state, metadata)
        raise OSError("simulated crash before publication")

    broken = copy.copy(backend)
    broken._write = crash_after_writing
    train(model, "sequential")
    with pytest.raises(OSError, match="simulated crash"):
        broken.save(model, directory / "latest", state=TrainingState(epoch=3))
    assert [p.name for p in directory.iterdir()] == [path.name], "failed save left files"
    checkpoint = backend.load(path)
    assert checkpoint.state.epoch == 2
    np.testing.assert_array_equal(outputs(checkpoint.model, x), second)


def check_crash_leftovers_not_loadable(backend: SaveBackend, directory: Path) -> None:
    """What a crashed writer leaves behind is never taken for a checkpoint."""
    directory = Path(directory) / "crash"
    directory.mkdir()
    model = build_model("sequential")
    train(model, "sequential")
    meta = backend.build_metadata(model, TrainingState(epoch=1), {})

    # 1. Complete content in a temporary sibling: the process died before the rename.
    final = backend.checkpoint_path(directory / "crashed")
    tmp = temporary_sibling(final)
    if backend.is_directory:
        tmp.mkdir()
    backend._write(model, tmp, TrainingState(epoch=1), meta)
    assert not final.exists()
    for load in (load_checkpoint, backend.load):
        with pytest.raises(NotACheckpointError):
            load(tmp)

    # 2. A torn copy published under a real name (every file cut in half) is refused.
    torn = backend.checkpoint_path(directory / "torn")
    tmp.rename(torn)
    for file in [torn] if torn.is_file() else [p for p in torn.rglob("*") if p.is_file()]:
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    if type(backend).can_load(torn):
        with pytest.raises(TrainerError):
            backend.load(torn)
    torn.rename(tmp)
    assert clean_stale_temporaries(directory) == [tmp]
    assert list(directory.iterdir()) == []


SAFETY_CHECKS = (
    check_unbuilt_model_rejected,
    check_atomic_replace,
    check_crash_leftovers_not_loadable,
)


def check_backend(
    backend: SaveBackend, directory: Path, kinds: tuple[str, ...] = MODEL_KINDS
) -> None:
    """The whole contract for one backend instance; ``directory`` must be empty."""
    for kind in kinds:
        check_round_trip(backend, directory, kind)
    for check in SAFETY_CHECKS:
        check(backend, directory)
