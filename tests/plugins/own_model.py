"""A user's own model builder, as `model._target_` would name it (issue 39, item 5)."""

from __future__ import annotations

import keras


def build(input_shape, num_classes, hidden: int = 8):
    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.Dense(hidden, activation="relu")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="own")


class Scale(keras.layers.Layer):
    """A user's own layer, not registered with Keras (issue 39, item 1)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


def build_with_own_layer(input_shape, num_classes):
    inputs = keras.Input(tuple(input_shape))
    x = Scale(name="scale")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="own_layer")
