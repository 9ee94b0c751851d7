"""A legacy tf.keras SavedModel -> a compiled, trainable Keras 3 model.

The root's metadata holds the Keras 2 model config: it is translated (``translate``) and
rebuilt by Keras 3; layers Keras 3 cannot build (class missing, ``Lambda``, a custom class
named like a built-in: ``builtin``) become stand-ins over their traced functions
(``standin``); variables come from the checkpoint by object path (``weights``); the compile
arguments from ``training_config`` (``compiling``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import live_objects
from trainer.errors import CorruptCheckpointError, TrainerError, UnsupportedLegacyError
from trainer.save_backends.legacy import (
    builtin,
    compiling,
    traced_layers,
    translate,
    variable_values,
)
from trainer.save_backends.legacy.reader import (
    GRAPH_CLASSES,
    LegacyDir,
    Node,
    every_layer,
    open_legacy,
)

log = logging.getLogger(__name__)


def plan(legacy: LegacyDir, custom_objects: dict[str, Any]) -> dict[str, str]:
    """Layer name (``inner_model/layer`` inside nested Functional and Sequential models) ->
    how it imports: ``config`` (Keras 3 builds it) or ``traces``."""
    how = {}
    for name, node in every_layer(legacy).items():
        class_name = str(node.metadata.get("class_name", ""))
        known = builtin.known_class(class_name, node.metadata.get("config"), custom_objects)
        how[name] = "config" if known else "traces"
    return how


def import_model(
    path: Path, *, custom_objects: dict[str, Any] | None = None, compile: bool = True
) -> tuple[keras.Model, dict[str, Any]]:
    """The Keras 3 model and what the import did (for the checkpoint metadata)."""
    custom_objects = dict(custom_objects or {})
    legacy = open_legacy(path)
    where = str(path)
    config = translate.root_config(legacy.root.metadata, where)
    how = plan(legacy, custom_objects)
    revived = {n: node for n, node in every_layer(legacy).items() if how[n] == "traces"}
    loaded = None
    objects = dict(custom_objects)
    if revived:
        loaded = _load_saved_model(path)
        objects[traced_layers.CLASS_NAME] = traced_layers.factory(legacy, loaded, revived)
        _substitute(config["config"]["layers"], revived, "")
    model = _build(config, objects, where)
    _warn_impostors(revived, custom_objects, where)
    if loaded is not None:
        # its functions are in use
        live_objects.set_marker(model, live_objects.LOADED_SAVEDMODEL, loaded)
    variable_values.assign_model(legacy, model, legacy.root, where)
    info: dict[str, Any] = {"imported_from": "tf_keras", "legacy_layers": how}
    training_config = legacy.root.metadata.get("training_config")
    if compile and training_config:
        info.update(compiling.compile_from_legacy(model, legacy, training_config, objects))
    elif compile:
        log.warning("%s holds no training config; the imported model is not compiled", path)
    return model, info


def _warn_impostors(revived: dict[str, Node], custom_objects: dict[str, Any], where: str) -> None:
    """Say which layers named like a Keras built-in were revived from their traces: a
    stand-in where the user may have expected Keras' class (h5 and weights refuse it)."""
    for name, node in revived.items():
        class_name = str(node.metadata.get("class_name"))
        if builtin.names_builtin(class_name):
            reason = builtin.doubt(class_name, node.metadata.get("config"), custom_objects)
            log.warning(
                "%s: layer %r is recorded as %s but is not Keras' %s (%s): probably a custom "
                "class of that name (or a tf.keras older than 2.21 wrote it), so it was "
                "revived from its traced functions. To rebuild it instead, pass its class in "
                "custom_objects (keras.layers.%s if it is Keras' own).",
                where,
                name,
                class_name,
                class_name,
                reason,
                class_name,
            )


def _substitute(entries: list[dict[str, Any]], revived: dict[str, Node], prefix: str) -> None:
    """Point the config entries of the layers revived from traces (at every depth of nested
    Functional and Sequential models) to the stand-in factory, by qualified name."""
    for entry in entries:
        config = entry.get("config") or {}
        key = f"{prefix}{config.get('name')}"
        if key in revived:
            entry["class_name"] = traced_layers.CLASS_NAME
            entry["config"] = {"name": config.get("name"), "trainer_key": key}
        elif entry.get("class_name") in GRAPH_CLASSES and "layers" in config:
            _substitute(config["layers"], revived, f"{key}/")


def _load_saved_model(path: Path) -> Any:
    try:
        return tf.saved_model.load(str(path))
    except Exception as error:  # any TF error here means a damaged directory
        raise CorruptCheckpointError(
            f"{path} cannot be loaded as a SavedModel ({type(error).__name__}: {error}); "
            f"its traced functions are needed for the layers whose class is missing. "
            f"Received: {str(path)!r}"
        ) from error


def _build(config: dict[str, Any], objects: dict[str, Any], where: str) -> keras.Model:
    cls = keras.Sequential if config["class_name"] == "Sequential" else keras.Model
    try:
        with keras.saving.custom_object_scope(objects):
            return cls.from_config(config["config"], custom_objects=objects)
    except TrainerError:
        raise
    except Exception as error:  # Keras raises TypeError/ValueError/KeyError on a bad config
        cause = _own_error_in_chain(error)
        if cause is not None:  # ours, wrapped by Keras' deserialization
            raise cause from error
        raise UnsupportedLegacyError(
            f"Keras 3 cannot rebuild the model of {where} from its translated config "
            f"({type(error).__name__}: {error}). A layer class or option it uses has no "
            f"Keras 3 counterpart; pass the class in custom_objects if it is custom. "
            f"Received: {type(error).__name__}"
        ) from error


def _own_error_in_chain(error: BaseException) -> TrainerError | None:
    """The first of trainer's errors in ``error``'s chain of causes, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TrainerError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def describe(path: Path, custom_objects: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``inspect`` prints for a legacy directory, without building the model."""
    legacy = open_legacy(path)
    root = legacy.root.metadata
    how = plan(legacy, dict(custom_objects or {}))
    layers = every_layer(legacy)
    return {
        "format": "legacy tf.keras SavedModel (TensorFlow 2.x model.save)",
        "class_name": root.get("class_name"),
        "name": root.get("name"),
        "keras_version": root.get("keras_version"),
        "compiled": bool(root.get("training_config")),
        "layers": [
            {"name": n, "class_name": _class(layers[n]), "imports_from": how[n]} for n in how
        ],
    }


def _class(node: Node) -> str:
    return str(node.metadata.get("class_name"))
