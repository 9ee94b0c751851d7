"""Tuples that Keras's own ``from_config`` requires back after a config went through JSON.

JSON has no tuples, so a stored config holds lists where ``get_config`` returned tuples.
Keras's loaders accept that almost everywhere, but not in every class: Keras 3.15's
``Int4QuantizationConfig`` requires its weight quantizer's ``value_range`` to equal the
tuple ``(-8, 7)`` and rejects the list ``[-8, 7]``, so an int4-quantized ``Dense`` with a
custom quantizer saved by any backend (and by Keras's own ``.keras``) could not be loaded.
``restore`` puts such tuples back in a stored config before it is deserialized.
"""

from __future__ import annotations

from typing import Any

# (class name suffix, key) of serialized Keras objects whose value must be a tuple.
_TUPLE_KEYS = (("Quantizer", "value_range"),)


def restore(config: Any) -> Any:
    """``config`` with the tuples of ``_TUPLE_KEYS`` restored, in place (also returned)."""
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            name, inner = item.get("class_name"), item.get("config")
            if isinstance(name, str) and isinstance(inner, dict):
                for suffix, key in _TUPLE_KEYS:
                    if name.endswith(suffix) and isinstance(inner.get(key), list):
                        inner[key] = tuple(inner[key])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return config
