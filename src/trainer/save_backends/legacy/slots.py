"""The legacy optimizer's state (iterations, per-variable slots) -> the Keras 3 optimizer.

A legacy slot variable is recorded in ``saved_model.pb`` under ``<optimizer>/<kind>/<name
of the model variable>``, so each slot is tied to one model variable by the format itself;
the model variable was placed by object path (``weights``), which ties it to the Keras 3
variable. Slots are restored only when every Keras 3 slot finds its legacy value; else
none is, and a warning says so (a partial restore would mix fresh and trained state).
An optimizer with ``use_ema`` also has an ``average`` of each variable (the moving average
``fit`` ends by copying into the weights): restored like a slot, so without its averages
the optimizer keeps none of its state (Keras 3 would average from zeros while
``iterations`` said the averages were under way).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from trainer._compat import keras_training as training_compat
from trainer.save_backends.legacy.reader import LegacyDir

log = logging.getLogger(__name__)
# Keras 3 class -> {Keras 2 slot kind: Keras 3 slot list attribute}.
_KINDS = {
    "Adam": {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"},
    "AdamW": {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"},
    "SGD": {"m": "momentums"},
    "RMSprop": {
        "velocity": "_velocities",
        "momentum": "_momentums",
        "average_gradient": "_average_gradients",
    },
}
# The same for tf.keras.optimizers.legacy.* (OptimizerV2), by its slot names. Their updates
# are Keras 3's (Adam's bias-corrected step and epsilon outside the root, RMSprop's epsilon
# inside it, SGD's momentum sign): checked in tf_keras 2.21's and Keras 3.15.1's source.
_LEGACY_KINDS = {
    "Adam": {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"},
    "SGD": {"momentum": "momentums"},
    "RMSprop": {"rms": "_velocities", "momentum": "_momentums", "mg": "_average_gradients"},
}
# Any optimizer with ``use_ema``: {Keras 2 slot kind: Keras 3 list attribute}.
_EMA_KINDS = {"average": "_model_variables_moving_average"}


def _variable_names(legacy: LegacyDir) -> dict[int, str]:
    return {i: variable.name for i, variable in legacy.saved_variables().items()}


def restore(model: keras.Model, legacy: LegacyDir) -> str:
    """Restore what can be restored; returns ``restored``, ``none saved`` or why not."""
    optimizer_id = legacy.children(legacy.root.node_id).get("optimizer")
    if optimizer_id is None:
        log.warning("%s holds no optimizer state; the optimizer starts fresh", legacy.path)
        return "none saved"
    model.optimizer.build(model.trainable_variables)
    optimizer = training_compat.innermost_optimizer(model.optimizer)  # the slots' owner
    children = legacy.children(optimizer_id)
    if "_variables" in children:  # tf.keras.optimizers.* (tf_keras' optimizer.Optimizer)
        saved = len(legacy.listed(optimizer_id, "_variables")) > 1  # not only iterations
        kinds, find = _KINDS, _by_name(legacy)
    else:  # tf.keras.optimizers.legacy.* (OptimizerV2): slots tied to variables by the graph
        references = legacy.graph.nodes[optimizer_id].slot_variables
        saved = bool(references)
        kinds, find = _LEGACY_KINDS, _by_reference(references)
    if not saved and _needs_slots(optimizer, kinds):
        log.warning("%s holds no optimizer slots; the optimizer starts fresh", legacy.path)
        return "none saved"
    reason = _restore_slots(optimizer, legacy, kinds, find)
    scale = _loss_scale(model.optimizer, legacy, children)
    reason = reason or (scale if isinstance(scale, str) else None)
    if reason:
        log.warning(
            "Optimizer slots of %s not restored (%s); the optimizer starts fresh",
            legacy.path,
            reason,
        )
        return f"not restored: {reason}"
    iterations = children.get("_iterations", children.get("iter"))
    if iterations is not None:
        optimizer.iterations.assign(int(legacy.read(iterations)))
    for variable, array in scale or ():
        variable.assign(np.asarray(array, dtype=variable.dtype))
    return "restored"


def _needs_slots(optimizer: Any, table: dict) -> bool:
    """Whether the Keras 3 optimizer has any slot to fill (SGD without momentum has none:
    its iteration count, which a schedule reads, is all its state)."""
    kinds = table.get(type(optimizer).__name__)
    if kinds is None:
        return True
    if getattr(optimizer, "use_ema", False):
        kinds = {**kinds, **_EMA_KINDS}
    lists = [training_compat.optimizer_slot_list(optimizer, a) or [] for a in kinds.values()]
    return any(slot is not None for slots in lists for slot in slots)


def _loss_scale(optimizer: Any, legacy: LegacyDir, children: dict[str, int]) -> Any:
    """[(Keras 3 variable, saved value)] of a mixed-precision model's dynamic loss scale
    (tf_keras' ``loss_scale/current_loss_scale`` and ``good_steps``: Keras 3's
    ``dynamic_scale`` and ``step_counter``); [] without one; why not, as a string."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return []
    saved = legacy.children(children["loss_scale"]) if "loss_scale" in children else {}
    found = [saved.get("current_loss_scale"), saved.get("good_steps")]
    if any(node is None or legacy.value_key(node) is None for node in found):
        return "no saved dynamic loss scale"
    targets = [optimizer.dynamic_scale, optimizer.step_counter]
    return [(variable, legacy.read(node)) for variable, node in zip(targets, found, strict=True)]


# (legacy model variable node id, Keras 2 slot kind) -> slot node id, or why there is none
_Find = Callable[[int, str], "int | str"]


def _by_name(legacy: LegacyDir) -> _Find:
    """tf_keras' optimizer names a slot ``<optimizer>/<kind>/<variable name>`` (without
    ``<optimizer>/`` inside a ``LossScaleOptimizerV3``)."""
    names = _variable_names(legacy)
    by_name = {name: node_id for node_id, name in names.items()}

    def find(model_node: int, kind: str) -> int | str:
        slot = f"{kind}/{names.get(model_node)}"  # a LossScaleOptimizerV3's: no prefix
        wanted = [n for n in by_name if n == slot or n.endswith(f"/{slot}")]
        if len(wanted) != 1:
            return f"no single saved {kind!r} slot for {names.get(model_node)!r}"
        return by_name[wanted[0]]

    return find


def _by_reference(references: Any) -> _Find:
    """OptimizerV2's slots are the checkpoint graph's ``slot_variables`` of the optimizer
    node: (model variable node, slot name, slot node)."""
    slots = {
        (r.original_variable_node_id, r.slot_name): r.slot_variable_node_id for r in references
    }

    def find(model_node: int, kind: str) -> int | str:
        found = slots.get((model_node, kind))
        return f"no saved {kind!r} slot for variable node {model_node}" if found is None else found

    return find


def _restore_slots(optimizer: Any, legacy: LegacyDir, table: dict, find: _Find) -> str | None:
    kinds = table.get(type(optimizer).__name__)
    if kinds is None:
        return f"no slot mapping for {type(optimizer).__name__}"
    if getattr(optimizer, "use_ema", False):
        kinds = {**kinds, **_EMA_KINDS}
    placed = {id(v): node_id for node_id, v in legacy.placed.items()}
    built_for = training_compat.optimizer_built_for(optimizer)
    assignments = []
    for kind, attribute in kinds.items():
        slots = training_compat.optimizer_slot_list(optimizer, attribute) or []
        for variable, slot in zip(built_for, slots, strict=False):
            if slot is None:
                continue
            model_node = placed.get(id(variable))
            if model_node is None:
                return f"model variable {variable.path!r} has no legacy counterpart"
            slot_node = find(model_node, kind)
            if isinstance(slot_node, str):
                return slot_node
            array = legacy.read(slot_node) if legacy.value_key(slot_node) else None
            if array is None or tuple(array.shape) != tuple(slot.shape):
                return f"the saved {kind!r} slot of {variable.path!r} does not fit"
            assignments.append((slot, array))
    for slot, array in assignments:
        slot.assign(np.asarray(array, dtype=slot.dtype))
    return None
