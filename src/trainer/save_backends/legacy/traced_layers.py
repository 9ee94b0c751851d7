"""Layers revived from a legacy SavedModel's traced functions (class missing, ``Lambda``).

The stand-in keeps the saved name, holds sublayers under the saved attribute names, owns
Keras variables whose storage is the loaded ``tf.Variable`` the traced functions capture
(so training one trains the other), and calls the traced
``call_and_return_conditional_losses`` for the current ``training`` value, re-adding the
losses it returns. No Python code stored in the directory runs.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.errors import RevivedCallError, UnsupportedLegacyError
from trainer.save_backends.legacy import builtin, translate
from trainer.save_backends.legacy.reader import LegacyDir, Node
from trainer.save_backends.legacy.variable_values import layer_children, own_legacy_variables

CLASS_NAME = "TrainerLegacyRevived"


def loaded_object(loaded: Any, node: Node) -> Any:
    """The object ``tf.saved_model.load`` made for ``node``, reached by its object path."""
    found = loaded
    for part in node.path.split(".")[1:]:
        found = getattr(found, part)
    return found


def _attach(
    legacy: LegacyDir, layer: keras.layers.Layer, node: Node, obj: Any, prefix: str = ""
) -> set[int]:
    """Wrap the variables of ``node`` into ``layer``, named by their object path
    (``inner/kernel``). A sublayer of a class Keras 3 builds itself, with no sublayers of
    its own, is rebuilt and kept under its attribute (``layer.inner``: ``summary`` shows
    it), over the same variables; any other sublayer's variables are wrapped into
    ``layer`` (a stand-in of it could not be saved again: it has no traced call of its
    own). The traced call of ``layer`` uses them all. Returns the ids of the traced weight
    regularizers that rebuilt sublayers compute themselves (Keras 3 adds their losses)."""
    names = {v: k for k, v in legacy.children(node.node_id).items()}
    for variable_id, trainable in own_legacy_variables(legacy, node):
        storage = getattr(obj, names[variable_id])
        flag = storage.trainable if trainable is None else trainable
        path = f"{prefix}{names[variable_id]}"
        variable = keras_compat.variable_over_storage(storage, name=path, trainable=flag)
        keras_compat.track_variable(layer, variable)
        legacy.placed[variable_id] = variable
    computed: set[int] = set()
    for attribute, child in layer_children(legacy, node).items():
        child_obj = getattr(obj, attribute)
        rebuilt = None
        if attribute.isidentifier() and not hasattr(layer, attribute):
            rebuilt = _rebuilt_sublayer(legacy, child, child_obj)
        if rebuilt is None:
            computed |= _attach(legacy, layer, child, child_obj, f"{prefix}{attribute}/")
        else:
            setattr(layer, attribute, rebuilt)
            computed |= {id(f) for f in getattr(child_obj, "regularization_losses", None) or []}
    return computed


def _rebuilt_sublayer(legacy: LegacyDir, node: Node, obj: Any) -> keras.layers.Layer | None:
    """The Keras 3 layer of ``node``'s own (built-in or registered) class, built and over
    the loaded variables themselves, or None where that cannot be done exactly: class
    unknown, sublayers of its own, variables that do not pair one to one (count, shape,
    trainability, in recorded order)."""
    metadata = node.metadata
    class_name = str(metadata.get("class_name"))
    known = builtin.known_class(class_name, metadata.get("config"), {})
    if layer_children(legacy, node) or not known:
        return None
    entry = {"class_name": class_name, "config": metadata.get("config")}
    shape = translate.plain(metadata.get("build_input_shape"))
    try:
        config = translate.layer_config(translate.plain(entry), str(legacy.path))["config"]
        cls = keras.saving.get_registered_object(class_name) or getattr(keras.layers, class_name)
        layer = cls.from_config(config)
        layer.build(tuple(shape) if isinstance(shape, list) else shape)
    except Exception:  # a config or shape Keras 3 takes otherwise: keep the flat variables
        return None
    names = {v: k for k, v in legacy.children(node.node_id).items()}
    source = own_legacy_variables(legacy, node)
    weights = {id(v) for v in layer.weights}  # not the seed generators' RNG states
    trainable = {id(v) for v in keras_compat.own_trainable_variables(layer)}
    target = [v for v in keras_compat.own_variables(layer) if id(v) in weights]
    pairs = []
    for flag in (True, False):
        sources = [v for v, t in source if t == flag]
        targets = [v for v in target if (id(v) in trainable) == flag]
        if len(sources) != len(targets):
            return None
        pairs += list(zip(sources, targets, strict=True))
    if len(pairs) != len(source) or len(pairs) != len(target):
        return None  # trainability not recorded (None): no safe pairing
    storages = [getattr(obj, names[v]) for v, _ in pairs]
    if any(tuple(s.shape) != tuple(t.shape) for s, (_, t) in zip(storages, pairs, strict=True)):
        return None
    for storage, (variable_id, variable) in zip(storages, pairs, strict=True):
        keras_compat.set_variable_storage(variable, storage)
        legacy.placed[variable_id] = variable
    layer.trainable = metadata.get("trainable", True)
    return layer


class LegacyRevivedLayer(keras.layers.Layer):
    """One legacy layer whose Python class is not available (or a ``Lambda``); a subclass
    named after the original class is made per class (``standin_class``). Its class
    carries ``live_objects.REVIVED_FROM`` (set below): backends that store configs only
    refuse such layers."""

    def __init__(self, *, legacy, node, loaded, **kwargs):
        metadata = node.metadata
        super().__init__(
            name=metadata.get("name"), trainable=metadata.get("trainable", True), **kwargs
        )
        obj = loaded_object(loaded, node)
        api = getattr(obj, "keras_api", None)
        function = getattr(api, "call_and_return_conditional_losses", None)
        if function is None:
            raise _untraced(self.name, metadata, legacy)
        live_objects.set_marker(self, live_objects.LEGACY_TRACED_CALL, function)
        extra = _extra_arguments(function)
        live_objects.set_marker(self, live_objects.LEGACY_EXTRA_ARGUMENTS, extra)
        entry = {"class_name": metadata.get("class_name"), "config": metadata.get("config")}
        config = translate.layer_config(translate.plain(entry), str(legacy.path))["config"]
        live_objects.set_marker(self, live_objects.LEGACY_CONFIG, config)
        live_objects.set_marker(self, live_objects.LEGACY_REVIVED, True)
        computed = _attach(legacy, self, node, obj)
        # Argument-free traced weight regularizers (its sublayers' included, except those
        # of rebuilt sublayers: Keras 3 adds theirs), re-added on every call as Keras 2
        # added them to the loss of every step.
        regularizers = list(getattr(obj, "regularization_losses", None) or [])
        regularizers = [f for f in regularizers if id(f) not in computed]
        live_objects.set_marker(self, live_objects.LEGACY_REGULARIZERS, regularizers)
        self.built = True

    def call(self, inputs, training=None):
        if any(keras_compat.keras_mask(x) is not None for x in tf.nest.flatten(inputs)):
            raise UnsupportedLegacyError(
                f"Layer {self.name!r} is revived from traced functions, which were traced "
                f"without the Keras mask its inputs carry; it would ignore the mask. Pass its "
                f"class in custom_objects. Received: masked inputs for {self.name!r}"
            )
        # After the inputs, as traced: the training flag where a bool was, else the value
        # the trace fixed (a mask traced as None).
        traced = live_objects.get_marker(self, live_objects.LEGACY_EXTRA_ARGUMENTS)
        extra = [bool(training) if isinstance(v, bool) else v for v in traced]
        arguments = (inputs, *extra)
        function = live_objects.get_marker(self, live_objects.LEGACY_TRACED_CALL)
        try:
            outputs, losses = function(*arguments)
        except (TypeError, ValueError) as error:  # no traced function takes these inputs
            raise RevivedCallError(
                f"Layer {self.name!r} was revived from the traced functions of a legacy "
                f"SavedModel, and none of them takes these inputs ({error}). Call it with "
                f"inputs of the shapes and dtypes it was saved with, or pass its class in "
                f"custom_objects. Received: {inputs!r}"
            ) from error
        regularizers = live_objects.get_marker(self, live_objects.LEGACY_REGULARIZERS)
        for loss in list(losses or []) + [f() for f in regularizers]:
            self.add_loss(loss)
        return outputs

    def get_config(self):
        """The original layer's config: a process that has its class rebuilds it."""
        config = live_objects.get_marker(self, live_objects.LEGACY_CONFIG)
        return {**config, "name": self.name, "trainable": self.trainable}


live_objects.set_marker(
    LegacyRevivedLayer, live_objects.REVIVED_FROM, "a legacy tf.keras SavedModel"
)


def _untraced(name: str, metadata: dict[str, Any], legacy: LegacyDir) -> UnsupportedLegacyError:
    """The error for a layer to revive that was saved without traced functions."""
    class_name = str(metadata.get("class_name"))
    received = f"Received: class_name={class_name!r}"
    if not builtin.names_builtin(class_name):
        return UnsupportedLegacyError(
            f"Layer {name!r} ({class_name}) of {legacy.path} has no Python class here and "
            f"was saved without traced functions (save_traces=False), so it cannot be "
            f"revived. Pass its class in custom_objects. {received}"
        )
    reason = builtin.doubt(class_name, metadata.get("config"), {})
    return UnsupportedLegacyError(
        f"Layer {name!r} ({class_name}) of {legacy.path} is recorded under the name of a "
        f"Keras layer, but its config does not match Keras 3's built-in {class_name} "
        f"({reason}): probably a custom class with the same name, which rebuilt as the "
        f"built-in would compute something else. It was saved without traced functions "
        f"(save_traces=False), so it cannot be revived from them either. Pass its class in "
        f"custom_objects (custom_objects={{{class_name!r}: cls}}; keras.layers.{class_name} "
        f"if it is Keras' own, saved by a tf.keras older than 2.21 whose class lacked those "
        f"options). {received}, config keys={sorted(metadata.get('config') or {})}"
    )


_classes: dict[str, type] = {}


def standin_class(class_name: str) -> type:
    """A ``LegacyRevivedLayer`` subclass reporting the original class name, so that a save
    of the imported model records it (a ``Lambda`` becomes ``LegacyLambda``: its stored
    code is never to be rebuilt)."""
    name = "LegacyLambda" if class_name == "Lambda" else class_name
    if name not in _classes:
        _classes[name] = type(name, (LegacyRevivedLayer,), {"__module__": __name__})
    return _classes[name]


def _extra_arguments(function: Any) -> tuple:
    """The positional arguments after ``inputs`` that the traced call was traced with:
    Keras 2 traced ``mask`` (as None) and ``training`` (as True and as False) when the
    layer's ``call`` declared them, in the order it declared them."""
    concrete = tf_compat.concrete_functions(function)
    if not concrete:
        return ()
    return tuple(concrete[0].structured_input_signature[0][1:])


def factory(legacy: LegacyDir, loaded: Any, nodes: dict[str, Node]) -> type:
    """A class Keras' ``from_config`` builds the prepared stand-ins with, by qualified
    layer name (``inner_model/layer`` inside nested models)."""

    class _Factory:
        @classmethod
        def from_config(cls, config):
            node = nodes[config.get("trainer_key", config["name"])]
            cls = standin_class(str(node.metadata.get("class_name")))
            return cls(legacy=legacy, node=node, loaded=loaded)

    return _Factory
