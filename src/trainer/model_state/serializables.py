"""Registering the serializable classes a checkpoint may name, before it is loaded.

A checkpoint of a model built from trainer's own classes (``trainer>ResidualBlock``, the
pruning wrapper) or from a plugin's must find those classes registered with Keras when it
is loaded, in whatever process loads it. Importing them from the loader would make the
save backends depend on the model zoo and the wrappers above them, so the modules are
named here instead and imported on the first load: trainer's own, plus every module a
distribution declares under the ``trainer.model_state.serializables`` entry-point group.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "trainer.model_state.serializables"
# The project's own modules whose import registers classes (with keras.saving); the legacy
# import's activations are named by the checkpoints of the models it imported.
BUILTIN_MODULES = ("trainer.models", "trainer.wrapping", "trainer.save_backends.legacy.activations")
log = logging.getLogger(__name__)
_done = False


def register_serializables() -> None:
    """Import every module that registers serializable classes; once per process.

    A plugin module that fails to import is logged and skipped: its classes then count as
    missing, which the loaders handle (revival from traced functions, or a clear error).
    """
    global _done
    if _done:
        return
    _done = True
    for name in BUILTIN_MODULES:
        importlib.import_module(name)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except ImportError as error:
            log.warning(
                "entry point %s (%s) could not be imported: %s", entry.name, entry.value, error
            )
