"""Small real Keras models and data for the backend contract suite, and exact comparisons.

Three model kinds (``MODEL_KINDS``), each built and compiled differently: a Sequential
regression model compiled with plain strings, a Functional model around a custom layer that
holds layers of its own, and a ``keras.Model`` subclass with a learning-rate schedule. The
custom classes are registered with Keras under the package name ``trainer_testing``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

SEED = 1234
BATCH = 8
FEATURES = 6
CLASSES = 3
MODEL_KINDS = ("sequential", "functional", "subclassed")


# ------------------------------------------------------------------ small real models
@keras.saving.register_keras_serializable(package="trainer_testing")
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


@keras.saving.register_keras_serializable(package="trainer_testing")
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
