"""Hiding the Layer classes Keras's test modules define, for the peer suites' revival runs.

Shared by ``routing_plugin`` (the saving suites' ``savedmodel-revived`` run) and
``layer_round_trip`` (the layer suite's ``revived`` mode): a load inside
``test_classes_hidden()`` cannot find those classes, neither as module attributes (which
Keras's deserializer imports by module path) nor in Keras's registry, so it revives them
from their traced functions, as for a user who loads without the code.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

# The module ``layer_round_trip`` gives its subclassed wrapper, so that it counts as a
# test class too (never in ``sys.modules``: only the registry could hold it).
WRAPPER_MODULE = "peer_hidden_test"


def is_test_class(cls: type) -> bool:
    """A class defined by a Keras test module (or the layer suite's wrapper)."""
    module = getattr(cls, "__module__", "") or ""
    return module.endswith("_test") or module == WRAPPER_MODULE


@contextlib.contextmanager
def test_classes_hidden():
    """Remove every Layer class a ``keras.src.*_test`` module defines from that module, and
    every test class from Keras's registry; put them all back on exit."""
    import keras
    from keras.src.saving import object_registration

    hidden: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("keras.src.") and name.endswith("_test")):
            continue
        for attr, value in list(vars(module).items()):
            is_layer = isinstance(value, type) and issubclass(value, keras.layers.Layer)
            if is_layer and value.__module__ == name:
                hidden.append((module, attr, value))
                delattr(module, attr)
    registry = object_registration.GLOBAL_CUSTOM_OBJECTS
    names = object_registration.GLOBAL_CUSTOM_NAMES
    removed = {key: cls for key, cls in registry.items() if is_test_class(cls)}
    for key in removed:
        registry.pop(key)
    saved_names = {cls: names.pop(cls) for cls in removed.values() if cls in names}
    try:
        yield
    finally:
        for module, attr, value in hidden:
            setattr(module, attr, value)
        registry.update(removed)
        names.update(saved_names)
