"""The tf_keras 2.21 anchor's measurements: legacy ``save_format="tf"`` save and
``load_model`` on the same architecture as the Keras 3 side, built with tf_keras.

Imported only by ``benchmarks.tfkeras_anchor`` in its own process: tf_keras and Keras 3
in one process interfere, so this module must never import Keras 3 (nor
``benchmarks.models``).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tf_keras

from benchmarks.specs import (
    BATCH,
    BLOCK_NAME,
    NUM_CLASSES,
    PACKAGE,
    SIZES,
    Size,
    input_shape,
)
from benchmarks.timing import Result, not_available, remove, timed

layers = tf_keras.layers


@tf_keras.saving.register_keras_serializable(package=PACKAGE, name=BLOCK_NAME)
class DenseResidualBlock(layers.Layer):
    """Same block as ``benchmarks.models.DenseResidualBlock``, written for tf_keras."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.inner = layers.Dense(width, activation="relu")
        self.outer = layers.Dense(width)

    def call(self, inputs):
        return tf_keras.activations.relu(inputs + self.outer(self.inner(inputs)))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def build(size: Size, seed: int = 0) -> tf_keras.Model:
    tf_keras.utils.set_random_seed(seed)
    if size.kind == "dense":
        inputs = tf_keras.Input(shape=input_shape(size), name="features")
        x = layers.Dense(size.width, activation="relu", name="stem")(inputs)
        for index in range(size.blocks):
            x = DenseResidualBlock(size.width, name=f"block{index}")(x)
        outputs = layers.Dense(NUM_CLASSES, name="logits")(x)
        model = tf_keras.Model(inputs, outputs, name=f"bench_{size.name}")
    else:
        model = tf_keras.applications.MobileNetV2(
            input_shape=input_shape(size),
            alpha=size.alpha,
            weights=None,
            classes=NUM_CLASSES,
            classifier_activation=None,
        )
    model.compile(
        optimizer=tf_keras.optimizers.Adam(1e-3),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    train_step(model, size, seed)
    return model


def train_step(model: tf_keras.Model, size: Size, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, *input_shape(size))).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=BATCH).astype("int32")
    model.train_on_batch(x, y)


def measure_size(size: Size, repeats: int, root: Path) -> list[Result]:
    root.mkdir(parents=True, exist_ok=True)
    model = build(size)
    target = lambda i: root / f"tfk_{i}"  # noqa: E731
    save = timed(
        size.name,
        "tf_keras.save",
        'tf_keras model.save(dir, save_format="tf")',
        lambda i: model.save(str(target(i)), save_format="tf"),
        repeats,
        before=lambda i: train_step(model, size, 100 + i),
        artifact=target,
    )
    save.note = f"{model.count_params():,} parameters"
    last = target(repeats - 1)
    load = (
        timed(
            size.name,
            "tf_keras.load",
            "tf_keras.models.load_model(dir)",
            lambda i: tf_keras.models.load_model(str(last)),
            repeats,
        )
        if save.status == "ok"
        else not_available(size.name, "tf_keras.load", "tf_keras load_model", "save failed")
    )
    for i in range(repeats):
        remove(target(i))
    tf_keras.backend.clear_session()
    gc.collect()
    return [save, load]


def warm_up(root: Path) -> None:
    """One untimed save and load of the tiny model: import and first-use costs are paid
    here, as the Keras 3 side pays them in its own warm-up."""
    measure_size(SIZES["tiny"], 1, root / "warmup")
