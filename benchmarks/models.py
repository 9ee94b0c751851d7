"""The benchmarked Keras 3 models: compiled with Adam and trained one step, so every format
stores the same optimizer slots (a model saved before its first step has none)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np
from keras import layers

from benchmarks.specs import (
    BATCH,
    BLOCK_NAME,
    NO_BUILD_BLOCK_NAME,
    NUM_CLASSES,
    PACKAGE,
    Size,
    input_shape,
)


@keras.saving.register_keras_serializable(package=PACKAGE, name=BLOCK_NAME)
class DenseResidualBlock(layers.Layer):
    """Dense-ReLU-Dense added to its input: a custom class holding two sublayers, so a load
    without the class has to revive it from what the checkpoint stored."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.inner = layers.Dense(width, activation="relu")
        self.outer = layers.Dense(width)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.outer.build((*input_shape[:-1], self.width))

    def call(self, inputs):
        return keras.ops.relu(inputs + self.outer(self.inner(inputs)))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "width": self.width}


@keras.saving.register_keras_serializable(package=PACKAGE, name=NO_BUILD_BLOCK_NAME)
class DenseResidualBlockNoBuild(layers.Layer):
    """``DenseResidualBlock`` without ``build()``, as Keras's guides write blocks: Keras
    builds its sublayers by running its call on symbolic inputs (at load too)."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.inner = layers.Dense(width, activation="relu")
        self.outer = layers.Dense(width)

    def call(self, inputs):
        return keras.ops.relu(inputs + self.outer(self.inner(inputs)))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def build(size: Size, seed: int = 0, *, train: bool = True) -> keras.Model:
    """The model of ``size``, compiled with Adam and trained on one batch.

    ``train=False`` only builds the optimizer (same slot variables, still zero): the model
    a first-save repeat needs, without tracing a training step for every repeat.
    """
    keras.utils.set_random_seed(seed)
    if size.kind == "dense":
        inputs = keras.Input(shape=input_shape(size), name="features")
        x = layers.Dense(size.width, activation="relu", name="stem")(inputs)
        block = DenseResidualBlock if size.block_build else DenseResidualBlockNoBuild
        for index in range(size.blocks):
            x = block(size.width, name=f"block{index}")(x)
        outputs = layers.Dense(NUM_CLASSES, name="logits")(x)
        model = keras.Model(inputs, outputs, name=f"bench_{size.name}")
    elif size.kind == "mobilenetv2":
        model = keras.applications.MobileNetV2(
            input_shape=input_shape(size),
            alpha=size.alpha,
            weights=None,
            classes=NUM_CLASSES,
            classifier_activation=None,
        )
    else:
        raise ValueError(f"Unknown model kind {size.kind!r} in size {size.name!r}")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    if train:
        train_step(model, size)
    else:
        model.optimizer.build(model.trainable_variables)
    return model


def batch(size: Size, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, *input_shape(size))).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=BATCH).astype("int32")
    return x, y


def train_step(model: keras.Model, size: Size, seed: int = 0) -> None:
    x, y = batch(size, seed)
    model.train_on_batch(x, y)


@contextlib.contextmanager
def block_class_missing(size: Size | None = None) -> Iterator[None]:
    """Unregister the custom block of ``size`` (``DenseResidualBlock`` by default) for the
    duration, as in a process that never imported the module defining it."""
    objects = keras.saving.get_custom_objects()
    name = BLOCK_NAME if size is None or size.block_build else NO_BUILD_BLOCK_NAME
    key = f"{PACKAGE}>{name}"
    removed = objects.pop(key)
    try:
        yield
    finally:
        objects[key] = removed
