"""Rebuilding objects from the configs a checkpoint stores, with errors that say why not.

Split from ``kit.py`` (whose public surface it stays part of: ``kit`` imports
``names_a_missing_class``) because this is where untrusted data meets Keras's deserializer,
and telling a missing class from stored code, a failing ``from_config`` and damage is a job
of its own.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import keras

from trainer.errors import (
    CorruptCheckpointError,
    MissingClassError,
    TrainerError,
    UnsafeCheckpointError,
)
from trainer.model_state import json_tuples, rebuild


def names_a_missing_class(entry: Any, custom_objects: dict[str, Any], safe_mode: bool) -> bool:
    """Whether the serialized object ``entry`` (a metric of a compile config) cannot be
    rebuilt because its class or function is not registered here. A string or anything
    else Keras resolves at ``compile`` counts as present."""
    if not (isinstance(entry, dict) and "class_name" in entry):
        return False
    try:
        deserialize(entry, custom_objects, safe_mode, "", "metric")
    except MissingClassError:
        return True
    except TrainerError:
        return False
    return False


def deserialize(config, custom_objects, safe_mode, where, what):
    """Keras's deserializer on a stored config, every failure turned into the
    ``TrainerError`` that says what is wrong: a class not registered here
    (``MissingClassError``), stored code (``UnsafeCheckpointError``), a class's own
    ``from_config`` failing, or damage."""
    try:
        return keras.saving.deserialize_keras_object(  # Keras pops from what it is given
            json_tuples.restore(copy.deepcopy(config)),
            custom_objects=custom_objects,
            safe_mode=safe_mode,
        )
    except TrainerError:
        raise
    except Exception as error:
        # Only Keras's deserializer and the stored classes' own from_config run inside this
        # try, on untrusted data, and a damaged config makes them raise nearly anything
        # (AttributeError for a non-string "module", RuntimeError "could not find layer",
        # found by tests/save_backends/test_untrusted_checkpoints.py's fuzzer). No trainer code
        # runs here, so nothing of ours is hidden by turning these into a clear error about the
        # checkpoint.
        message = str(error)
        missing = re.search(r"Could not locate (class|function) '([^']+)'", message)
        if missing:
            raise missing_class_error(
                config, missing.group(1), missing.group(2), where, what
            ) from error
        if "lambda" in message:
            problem = (
                f"{where}: the stored {what} holds a Python lambda, which would run code "
                f"from the checkpoint."
            )
            received = message.splitlines()[0]
            raise UnsafeCheckpointError(
                f"{problem} If you trust its source, load with safe_mode=False. "
                f"Received error: {received}",
                problem=problem,
                received=received,
            ) from error
        rebuilt = rebuild.rebuild_error(error, where, what)
        if rebuilt is not None:  # a class's own code failed: say so, not "damaged"
            raise rebuilt from error
        raise CorruptCheckpointError(
            f"{where}: the stored {what} could not be deserialized; the checkpoint is "
            f"damaged or was written with incompatible classes. Received error: {message}"
        ) from error


def missing_class_error(
    config: Any, kind: str, class_name: str, where: Any, what: str
) -> MissingClassError:
    """The error for a class (or function) this process does not know, with the fix that
    works. A name without ``package>`` was not registered when saved: registering the class
    now records it under another name (``package>Name``), so only ``custom_objects`` under
    the bare name finds it."""
    name = registered_name(config, class_name)
    value = "the_function" if kind == "function" else name.rsplit(">", 1)[-1]
    fix = f"pass custom_objects={{{name!r}: {value}}}"
    if ">" in name:
        how = (
            f"Import the module that defines it (decorated with "
            f"@keras.saving.register_keras_serializable) before loading, or {fix}."
        )
    else:
        how = (
            f"It was not registered when the checkpoint was saved, so {fix} (registering "
            f"it now would not help: Keras records a registered class as 'package>{name}'). "
            f"Resuming with train.py passes the classes of the configured model itself."
        )
    return MissingClassError(
        f"{where}: the stored {what} uses {name!r}, which is not registered in this process. "
        f"{how} Received: missing {name!r}"
    )


def registered_name(config: Any, class_name: str) -> str:
    """The ``package>Name`` Keras looks ``class_name`` up by, found in the stored config."""
    if isinstance(config, dict):
        if config.get("class_name") == class_name and config.get("registered_name"):
            return config["registered_name"]
        children = config.values()
    elif isinstance(config, list):
        children = config
    else:
        return class_name
    for child in children:
        found = registered_name(child, class_name)
        if found != class_name:
            return found
    return class_name
