"""The model zoo behind ``conf/model``: one model of each kind a save backend must handle.

``mlp`` is Sequential, ``cnn`` Functional, ``resnet`` Functional over a custom layer that
holds its own sublayers (layers within layers), ``subclassed`` a ``keras.Model`` subclass
with its own ``call``. Custom classes are registered so configs revive them by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import layers

PACKAGE = "trainer"


@keras.saving.register_keras_serializable(package=PACKAGE)
class ResidualBlock(layers.Layer):
    """Conv-BN-ReLU-Conv-BN plus a squeeze-style Dense gate, added to its input."""

    def __init__(self, filters: int, kernel_size: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.kernel_size = kernel_size
        self.conv1 = layers.Conv2D(filters, kernel_size, padding="same", use_bias=False)
        # momentum 0.9: the moving statistics catch up within an epoch of a small data set.
        self.bn1 = layers.BatchNormalization(momentum=0.9)
        self.conv2 = layers.Conv2D(filters, kernel_size, padding="same", use_bias=False)
        self.bn2 = layers.BatchNormalization(momentum=0.9)
        self.gate = layers.Dense(filters, activation="sigmoid")

    def build(self, input_shape):
        if input_shape[-1] != self.filters:
            raise ValueError(
                f"ResidualBlock {self.name!r} adds its input to its output, so the input needs "
                f"{self.filters} channels. Put a Conv2D with {self.filters} filters before it. "
                f"Received input shape {tuple(input_shape)}"
            )
        self.conv1.build(input_shape)
        self.bn1.build(input_shape)
        self.conv2.build(input_shape)
        self.bn2.build(input_shape)
        self.gate.build((input_shape[0], self.filters))

    def call(self, inputs, training=None):
        x = keras.ops.relu(self.bn1(self.conv1(inputs), training=training))
        x = self.bn2(self.conv2(x), training=training)
        gate = self.gate(keras.ops.mean(x, axis=(1, 2)))
        x = x * keras.ops.expand_dims(keras.ops.expand_dims(gate, 1), 1)
        return keras.ops.relu(x + inputs)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "kernel_size": self.kernel_size}


@keras.saving.register_keras_serializable(package=PACKAGE)
class SubclassedClassifier(keras.Model):
    """A model whose forward pass is Python code, not a layer graph."""

    def __init__(self, num_classes: int, hidden: int = 64, dropout: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.hidden = hidden
        self.dropout_rate = dropout
        self.flatten = layers.Flatten()
        self.dense1 = layers.Dense(hidden, activation="relu")
        self.dropout = layers.Dropout(dropout)
        self.dense2 = layers.Dense(hidden, activation="relu")
        self.head = layers.Dense(num_classes)

    def call(self, inputs, training=None):
        x = self.dense1(self.flatten(inputs))
        x = self.dropout(x, training=training)
        return self.head(self.dense2(x) + x)

    def get_config(self):
        return {
            "num_classes": self.num_classes,
            "hidden": self.hidden,
            "dropout": self.dropout_rate,
            "name": self.name,
        }


def build_mlp(
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] = (64, 64),
    dropout: float = 0.1,
) -> keras.Model:
    model = keras.Sequential(name="mlp")
    model.add(keras.Input(shape=tuple(input_shape), name="image"))  # the signature key
    model.add(layers.Flatten())
    for units in hidden:
        model.add(layers.Dense(units, activation="relu"))
        if dropout:
            model.add(layers.Dropout(dropout))
    model.add(layers.Dense(num_classes))
    return model


def build_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    filters: Sequence[int] = (16, 32),
    dropout: float = 0.1,
) -> keras.Model:
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = inputs
    for width in filters:
        x = layers.Conv2D(width, 3, padding="same", activation="relu")(x)
        x = layers.BatchNormalization(momentum=0.9)(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="cnn")


def build_resnet(
    input_shape: Sequence[int],
    num_classes: int,
    blocks: int = 2,
    width: int = 16,
) -> keras.Model:
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = layers.Conv2D(width, 3, padding="same", activation="relu", name="stem")(inputs)
    for index in range(blocks):
        x = ResidualBlock(width, name=f"block{index}")(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet")


def build_subclassed(
    input_shape: Sequence[int],
    num_classes: int,
    hidden: int = 64,
    dropout: float = 0.1,
) -> keras.Model:
    model = SubclassedClassifier(num_classes, hidden=hidden, dropout=dropout, name="subclassed")
    # Calling the model on one batch creates every sublayer's weights (build() alone
    # would only mark it built).
    model(keras.ops.zeros((1, *input_shape)))
    return model
