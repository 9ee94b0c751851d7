"""Keras 2 activations that Keras 3 names the same but computes differently.

``"hard_sigmoid"`` is ``clip(0.2 * x + 0.5, 0, 1)`` in Keras 2 (tf_keras ``backend
.hard_sigmoid``) and ``relu6(x + 3) / 6``, a slope of 1/6, in Keras 3: a legacy layer that
uses it by name (every ConvLSTM's default ``recurrent_activation``) gets this function
instead. It is registered (``trainer>legacy_hard_sigmoid``), so checkpoints of the imported
model name it and load wherever trainer registers its serializables. Every other activation
tf_keras 2.21 names computes the same in Keras 3 (compared on [-6, 6]).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="trainer")
def legacy_hard_sigmoid(x: Any) -> Any:
    """Keras 2's hard sigmoid, in its order of operations (multiply, add, clip)."""
    return ops.clip(ops.add(ops.multiply(x, 0.2), 0.5), 0.0, 1.0)


# Keras 2 name -> what Keras 3's config takes for the same function.
RENAMED: dict[str, Any] = {
    "hard_sigmoid": keras.saving.serialize_keras_object(legacy_hard_sigmoid),
}
ACTIVATION_KEYS = ("activation", "recurrent_activation")


def translated(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with each activation Keras 3 computes differently by name replaced."""
    for key in ACTIVATION_KEYS:
        value = config.get(key)
        if isinstance(value, str) and value in RENAMED:
            config[key] = dict(RENAMED[value])
    return config
