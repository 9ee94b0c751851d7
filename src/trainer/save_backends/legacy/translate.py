"""Keras 2 (tf.keras) layer and model configs -> configs Keras 3 builds the same layer from.

Only what differs is rewritten; an option Keras 3 has no counterpart for, and that would
change what the layer computes, is refused with an ``UnsupportedLegacyError`` naming the
layer (options that only chose an implementation, such as ``fused`` or ``implementation``,
are dropped: the math is the same).
"""

from __future__ import annotations

from typing import Any

import keras

from trainer.errors import UnsupportedLegacyError
from trainer.save_backends.legacy import activations, nodes

# Options Keras 3 dropped, removed whatever their value: they only chose an implementation,
# or the Keras 2 class accepted and recorded them but never read them (read in tf_keras 2.21's
# source, and checked there where noted).
_CONV_TRANSPOSE = ("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose")
_RANDOM = ("RandomBrightness", "RandomContrast", "RandomCrop", "RandomFlip", "RandomRotation")
_RANDOM += ("RandomTranslation", "RandomZoom")
_DROPPED = {
    "BatchNormalization": ("fused",),
    "LSTM": ("implementation", "time_major"),
    "GRU": ("implementation", "time_major"),
    "SimpleRNN": ("time_major",),
    "RNN": ("time_major",),
    "ConvLSTM1D": ("time_major",),
    "ConvLSTM2D": ("time_major",),
    "ConvLSTM3D": ("time_major",),
    "LSTMCell": ("implementation",),
    "GRUCell": ("implementation",),
    "Embedding": ("input_length",),
    "DepthwiseConv2D": ("groups",),
    "DepthwiseConv1D": ("groups",),
    # Keras 2's transposed convolutions take `groups` through Conv.__init__ and never read
    # it: build makes the full (*kernel_size, filters, in) kernel and call runs
    # conv_transpose, which has no groups (a groups=2 layer computes what groups=1 does,
    # checked). Keras 3's have no such option.
    **dict.fromkeys(_CONV_TRANSPOSE, ("groups",)),
    # Keras 2's SeparableConv inherits Conv's `groups` and `kernel_*` (its config lists
    # them) but its build creates only the depthwise and pointwise kernels, and its call runs
    # separable_conv2d without groups: the kernel regularizer adds no loss (checked).
    **dict.fromkeys(
        ("SeparableConv1D", "SeparableConv2D"),
        ("groups", "kernel_initializer", "kernel_regularizer", "kernel_constraint"),
    ),
    # query/key/value_shape: the input shapes Keras 2's from_config built the layer with
    # before its weights were restored; Keras 3 builds it from the graph's tensors, which
    # have those shapes. softmax_robust_masking: Keras 3's masked softmax (and its fused
    # dot_product_attention) is Keras 2's robust one, `where(mask, scores, -1e9)`. Keras 2's
    # default adds `(1 - mask) * -1e9` instead: a kept score is unchanged (+0.0) and a masked
    # one underflows to exactly 0 after exp in both, so every query row that keeps a key is
    # the same; only a row whose keys are ALL masked differs (Keras 3: uniform weights;
    # Keras 2: softmax of `score - 1e9` rounded, uniform only while |score| < 32) -- padding
    # rows whose output the model is not supposed to use.
    "MultiHeadAttention": ("query_shape", "key_shape", "value_shape", "softmax_robust_masking"),
    # Keras 2's SpatialDropout overrides _get_noise_shape (whole channels): the noise_shape
    # its Dropout base records is never read. Keras 3's takes no `trainable` (no **kwargs)
    # and, like Discretization below, has no variables for it to change.
    **dict.fromkeys(
        ("SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D"), ("noise_shape", "trainable")
    ),
    # Which random number generator draws the augmentation: identity at inference, and no
    # value reproduces Keras 2's random stream in Keras 3 (its SeedGenerator draws).
    **dict.fromkeys(_RANDOM, ("rng_type",)),
    # Keras 3's __init__ takes no `trainable` (no **kwargs); the layer has no variables (its
    # bin boundaries are config), so trainability changes nothing.
    "Discretization": ("trainable",),
}
# Options whose non-default value changes the math and has no Keras 3 counterpart.
_REFUSED = {
    "BatchNormalization": {
        "renorm": False,
        "virtual_batch_size": None,
        "adjustment": None,
    },
    "DepthwiseConv2D": {"groups": 1},
    "DepthwiseConv1D": {"groups": 1},
    "LSTM": {"time_major": False},
    "GRU": {"time_major": False},
    "SimpleRNN": {"time_major": False},
    # Keras 2's RNN base, ConvLSTM's included, ran time-major inputs (`[time, batch, ...]`,
    # a ConvLSTM1D built with time_major=True runs); Keras 3's have no such option.
    "RNN": {"time_major": False},
    "ConvLSTM1D": {"time_major": False},
    "ConvLSTM2D": {"time_major": False},
    "ConvLSTM3D": {"time_major": False},
}
# Kept as they are: CategoryEncoding's `sparse` (Keras 3's __init__ takes it with the same
# meaning, only its get_config omits it); the lookups' `has_input_vocabulary` (Keras 3's
# IndexLookup and TextVectorization read it), but see ``_refuse_lost_state``.
_LOOKUPS = ("StringLookup", "IntegerLookup", "TextVectorization")
_BN_DROPPED_WITH_RENORM = ("renorm", "renorm_clipping", "renorm_momentum")
CONTAINERS = ("Functional", "Model", "Sequential")
_POLICY_CLASSES = ("Policy", "PolicyV1")


def plain(value: Any) -> Any:
    """Keras 2's ``{"class_name": "__tuple__", "items": [...]}`` and ``TensorShape``
    wrappers -> lists, recursively."""
    if isinstance(value, dict):
        if value.get("class_name") in ("__tuple__", "TensorShape") and "items" in value:
            return [plain(v) for v in value["items"]]
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def layer_config(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """One ``{"class_name", "config", ...}`` layer entry translated; graph fields kept."""
    entry = dict(entry)
    class_name = entry.get("class_name")
    if class_name == "Model":
        class_name = entry["class_name"] = "Functional"
    config = _options(class_name, dict(entry.get("config") or {}), where)
    if class_name not in CONTAINERS:
        config = activations.translated(config)
    if class_name == "BatchNormalization":
        for option in _BN_DROPPED_WITH_RENORM:
            config.pop(option, None)
        axis = config.get("axis")
        if isinstance(axis, list) and len(axis) == 1:
            config["axis"] = axis[0]
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = _policy(config["dtype"])
    if class_name == "InputLayer":
        if "batch_input_shape" in config:
            config["batch_shape"] = config.pop("batch_input_shape")
        config.pop("ragged", None)
    elif class_name not in CONTAINERS:
        config.pop("batch_input_shape", None)
    for key in ("layer", "backward_layer", "cell", "cells"):  # wrappers and RNNs hold layers
        value = config.get(key)
        if isinstance(value, dict) and "class_name" in value:
            config[key] = _nested(value, where)
        elif key == "cells" and isinstance(value, list):
            config[key] = [_nested(v, where) if isinstance(v, dict) else v for v in value]
    if class_name in CONTAINERS:
        config = model_config(class_name, config, where)
    entry["config"] = config
    entry.pop("shared_object_id", None)
    return entry


def _options(class_name: Any, config: dict[str, Any], where: str) -> dict[str, Any]:
    """``config`` without the options Keras 3 dropped; an error for one whose value would
    make the rebuilt layer compute something else (``_REFUSED``, ``_refuse_lost_state``)."""
    name = config.get("name", "?")
    for option, default in _REFUSED.get(class_name, {}).items():
        if config.get(option, default) not in (default, False, None):
            raise UnsupportedLegacyError(
                f"Layer {name!r} ({class_name}) of {where} uses {option}="
                f"{config[option]!r}, which Keras 3 has no counterpart for; importing it would "
                f"compute something else. Re-save the model without it in TensorFlow 2.x. "
                f"Received: {option}={config[option]!r}"
            )
    _refuse_lost_state(class_name, config, where)
    for option in _DROPPED.get(class_name, ()):
        config.pop(option, None)
    return config


def _refuse_lost_state(class_name: Any, config: dict[str, Any], where: str) -> None:
    """Preprocessing state Keras 2 kept where the import cannot read it. A lookup's
    vocabulary from ``adapt()`` or ``set_vocabulary()`` lived only in a lookup table of the
    SavedModel, neither config nor variable (the model's config lists the vocabulary a layer
    was built with; the layer's own saved config never does, but says
    ``has_input_vocabulary``): Keras 3 would rebuild the layer without one, and its call
    fails ("Table not initialized"). An adapted ``Discretization`` (no ``bin_boundaries``)
    kept its quantile summary in a variable Keras 3's class does not have."""
    name = config.get("name", "?")
    if class_name in _LOOKUPS and config.get("vocabulary") is None:
        if config.get("has_input_vocabulary"):
            return
        lost, remedy = "vocabulary", "vocabulary=layer.get_vocabulary()"
        received = "vocabulary=None"
    elif class_name == "Discretization" and config.get("bin_boundaries") is None:
        lost, remedy = "bin boundaries", "bin_boundaries=layer.bin_boundaries"
        received = f"bin_boundaries=None, num_bins={config.get('num_bins')!r}"
    else:
        return
    raise UnsupportedLegacyError(
        f"Layer {name!r} ({class_name}) of {where} got its {lost} from adapt() in TensorFlow "
        f"2.x, and Keras 2 kept it where Keras 3 cannot read it, so the imported layer would "
        f"have none. In TensorFlow 2.x, rebuild the layer with {remedy} (the same values) and "
        f"save the model again. Received: {received}"
    )


def _nested(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """A layer held in a wrapper's or RNN's config, translated. Keras 3 deserializes it by
    ``module`` (none in Keras 2's configs), so a built-in's is named; a class in
    ``custom_objects`` or registered under the same name still wins (it is looked up first)."""
    entry = layer_config(entry, where)
    found = getattr(keras.layers, str(entry.get("class_name")), None)
    if "module" not in entry and isinstance(found, type) and issubclass(found, keras.layers.Layer):
        entry["module"] = "keras.layers"
    return entry


def _policy(value: dict[str, Any]) -> Any:
    if value.get("class_name") in _POLICY_CLASSES:
        return (value.get("config") or {}).get("name", "float32")
    return value


def model_config(class_name: str, config: dict[str, Any], where: str) -> dict[str, Any]:
    """A Functional or Sequential config with every layer translated; a Sequential whose
    first layer declared ``batch_input_shape`` gets the ``InputLayer`` Keras 3 needs."""
    config = dict(config)
    layers = [layer_config(entry, where) for entry in config.get("layers", [])]
    if class_name == "Sequential" and layers and layers[0]["class_name"] != "InputLayer":
        first = (config.get("layers") or [{}])[0].get("config", {})
        if first.get("batch_input_shape") is not None:
            batch = first["batch_input_shape"]
            dtype = first.get("dtype") if isinstance(first.get("dtype"), str) else None
            layers.insert(
                0,
                {
                    "class_name": "InputLayer",
                    "config": {"batch_shape": batch, "dtype": dtype or "float32"},
                },
            )
    config["layers"] = layers
    if class_name != "Sequential":
        nodes.renumber_nested_model_nodes(config, layers)
        nodes.resolve_tensor_arguments(layers)
    for key in ("input_layers", "output_layers"):  # one tensor: not a list of one
        ends = config.get(key)
        if isinstance(ends, list) and len(ends) == 1 and isinstance(ends[0], list):
            config[key] = ends[0]
    return config


def root_config(metadata: dict[str, Any], where: str) -> dict[str, Any]:
    """The whole model's Keras 3 ``{"class_name", "config"}`` from the root's metadata."""
    class_name = metadata.get("class_name")
    config = plain(metadata.get("config"))
    if class_name == "Model":
        class_name = "Functional"
    if class_name not in CONTAINERS or not isinstance(config, dict) or "layers" not in config:
        raise UnsupportedLegacyError(
            f"{where} holds a subclassed tf.keras model ({class_name}); only Functional and "
            f"Sequential models have the layer graph an import rebuilds. Re-save it as a "
            f"Functional model, or load it with tf.saved_model.load for inference. "
            f"Received: class_name={class_name!r}"
        )
    return {"class_name": class_name, "config": model_config(class_name, config, where)}
