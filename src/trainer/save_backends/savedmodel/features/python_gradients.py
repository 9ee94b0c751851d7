"""Layers whose traced calls take their gradient from Python (``tf.custom_gradient``).

A traced function holds the forward ops of such a call, and only a reference to its
gradient function, which is Python: a SavedModel does not hold it. A layer revived from its
traces then predicts exactly, but its first training step failed deep in TensorFlow
(``LookupError: No gradient defined for operation ...IdentityN``). The save records which
layers' traces use one (a parent's traces call its children's), and a revived layer refuses
a training call with a ``RevivedCallError`` saying why; with its class importable, it trains
as usual.
"""

from __future__ import annotations

from typing import Any

from trainer.errors import RevivedCallError

RECORD_KEY = "python_gradient"


def used(concrete: Any) -> bool:
    """Whether a concrete function's graph holds an op whose gradient is a Python function
    (``tf.custom_gradient`` marks it with ``_gradient_op_type``)."""
    for op in concrete.graph.get_operations():
        if op.type != "IdentityN":  # the op tf.custom_gradient wraps its outputs in
            continue
        try:
            op.get_attr("_gradient_op_type")
        except ValueError:
            continue
        return True
    return False


def propagate(records: list[dict[str, Any] | None]) -> None:
    """Mark every layer whose traced sublayers (at any depth) are marked: its own traces
    call theirs. ``records`` are indexed by layer id."""
    marked: dict[int, bool] = {}

    def mark(index: int) -> bool:
        if index not in marked:
            marked[index] = False  # a cycle (shared layers) counts once
            record = records[index] or {}
            children = [c["id"] for c in record.get("sublayers", [])]
            marked[index] = bool(record.get(RECORD_KEY)) or any(mark(c) for c in children)
            if marked[index] and records[index] is not None:
                records[index][RECORD_KEY] = True
        return marked[index]

    for index in range(len(records)):
        mark(index)


def refuse_training(layer: Any) -> RevivedCallError:
    return RevivedCallError(
        f"Layer {layer.name!r} ({type(layer).__name__}) was revived from its traced "
        f"functions (its class was not available at load time), and its call takes its "
        f"gradient from Python (tf.custom_gradient), which a SavedModel does not hold: it "
        f"predicts as saved, but cannot be trained. Make its class importable "
        f"(keras.saving.register_keras_serializable, or custom_objects) to train it, or "
        f"call it with training=False. Received: training=True"
    )
