"""Keras 2 (tf.keras) layer and model configs -> configs Keras 3 builds the same layer from.

Only what differs is rewritten; an option Keras 3 has no counterpart for, and that would
change what the layer computes, is refused with an ``UnsupportedLegacyError`` naming the
layer (options that only chose an implementation, such as ``fused`` or ``implementation``,
are dropped: the math is the same).
"""

from __future__ import annotations

from typing import Any

from trainer.errors import UnsupportedLegacyError

# Options Keras 3 dropped that select an implementation only.
_DROPPED = {
    "BatchNormalization": ("fused",),
    "LSTM": ("implementation", "time_major"),
    "GRU": ("implementation", "time_major"),
    "SimpleRNN": ("time_major",),
    "LSTMCell": ("implementation",),
    "GRUCell": ("implementation",),
    "Embedding": ("input_length",),
    "DepthwiseConv2D": ("groups",),
    "DepthwiseConv1D": ("groups",),
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
}
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
    config = dict(entry.get("config") or {})
    name = config.get("name", "?")
    for option, default in _REFUSED.get(class_name, {}).items():
        if config.get(option, default) not in (default, False, None):
            raise UnsupportedLegacyError(
                f"Layer {name!r} ({class_name}) of {where} uses {option}="
                f"{config[option]!r}, which Keras 3 has no counterpart for; importing it would "
                f"compute something else. Re-save the model without it in TensorFlow 2.x. "
                f"Received: {option}={config[option]!r}"
            )
    for option in _DROPPED.get(class_name, ()):
        config.pop(option, None)
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
    for key in ("layer", "backward_layer", "cell"):  # wrappers and RNNs hold layers
        if isinstance(config.get(key), dict) and "class_name" in config[key]:
            config[key] = layer_config(config[key], where)
    if class_name in CONTAINERS:
        config = model_config(class_name, config, where)
    entry["config"] = config
    entry.pop("shared_object_id", None)
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
        _renumber_nested_model_nodes(config, config.get("layers") or [])
    for key in ("input_layers", "output_layers"):  # one tensor: not a list of one
        ends = config.get(key)
        if isinstance(ends, list) and len(ends) == 1 and isinstance(ends[0], list):
            config[key] = ends[0]
    return config


def _skips_first_node(entry: dict[str, Any]) -> bool:
    """Keras 2 gave a nested Functional model (and a Sequential starting with an
    ``InputLayer``) a node of its own when it was built, and its config counts the calls in
    the outer graph from 1; Keras 3 gives it none and counts from 0."""
    if entry.get("class_name") in ("Functional", "Model"):
        return True
    if entry.get("class_name") == "Sequential":
        inner = (entry.get("config") or {}).get("layers") or [{}]
        return inner[0].get("class_name") == "InputLayer"
    return False


def _renumber_nested_model_nodes(config: dict[str, Any], layers: list[dict[str, Any]]) -> None:
    """References ``[name, node_index, tensor_index, ...]`` to such nested models, in the
    layers' ``inbound_nodes`` and the model's ``output_layers``, renumbered for Keras 3.
    (The entries are already translated: a Keras 2 Sequential's ``InputLayer`` is kept.)"""
    shifted = {
        (entry.get("config") or {}).get("name") for entry in layers if _skips_first_node(entry)
    }
    if not shifted:
        return

    def renumber(value: Any) -> Any:
        if isinstance(value, list):
            if (
                len(value) >= 3
                and isinstance(value[0], str)
                and value[0] in shifted
                and isinstance(value[1], int)
                and isinstance(value[2], int)
            ):
                return [value[0], max(value[1] - 1, 0), *value[2:]]
            return [renumber(v) for v in value]
        if isinstance(value, dict):
            return {k: renumber(v) for k, v in value.items()}
        return value

    for entry in layers:
        if "inbound_nodes" in entry:
            entry["inbound_nodes"] = renumber(entry["inbound_nodes"])
    if "output_layers" in config:
        config["output_layers"] = renumber(config["output_layers"])


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
