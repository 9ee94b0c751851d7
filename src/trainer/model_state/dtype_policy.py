"""The model's own dtype policy, kept with a checkpoint and put back around its rebuild.

Keras decides two things from the *global* dtype policy, not from a stored config: the
policy of a model object built from its config (a Functional model's config holds none), and
whether ``compile`` wraps the optimizer in a ``LossScaleOptimizer`` (under
``mixed_float16``). A model trained under ``keras.mixed_precision.set_dtype_policy(
"mixed_float16")`` and loaded in a new process (global policy ``float32``) would be
rebuilt with a plain optimizer that cannot take its saved loss-scale state. So a checkpoint
records the model's policy, and a load rebuilds and compiles under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras


def serialized_policy(model: keras.Model) -> dict[str, Any] | str | None:
    """``model``'s dtype policy as stored in a checkpoint (None if it has none)."""
    policy = getattr(model, "dtype_policy", None)
    return keras.dtype_policies.serialize(policy) if policy is not None else None


def stored_policy(value: Any) -> Any:
    """The policy a checkpoint recorded, or None (absent, or not one Keras knows: the
    record is untrusted, and only Keras' own policy classes are deserialized)."""
    if value is None:
        return None
    if isinstance(value, dict) and not str(value.get("class_name", "")).endswith("DTypePolicy"):
        return None  # not a policy: never hand another class to Keras' deserializer
    try:
        policy = keras.dtype_policies.deserialize(value)
        return keras.dtype_policies.get(policy)  # a name becomes the policy, or raises
    except (ValueError, TypeError, LookupError, AttributeError):
        return None  # rebuilt under the current global policy; each layer keeps its own


@contextlib.contextmanager
def global_policy(policy: Any) -> Iterator[None]:
    """Keras' global dtype policy set to ``policy`` within the block (None: unchanged)."""
    if policy is None:
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
