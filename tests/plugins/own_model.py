"""A user's own model builder, as `model._target_` would name it (issue 39, item 5)."""

from __future__ import annotations

import keras


def build(input_shape, num_classes, hidden: int = 8):
    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.Dense(hidden, activation="relu")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name="own")
