"""Layers whose traced calls take their gradient from Python (``tf.custom_gradient``).

A traced function holds the forward ops of such a call, and only a reference to its
gradient function, which is Python. A layer revived from its traces predicted exactly, but
its first training step failed deep in TensorFlow (``LookupError: No gradient defined for
operation ...IdentityN``). The save records which layers' traces use one (a parent's traces
call its children's), and saves those gradient functions traced
(``SaveOptions(experimental_custom_gradients=True)``, only for such a model: other saves
pay nothing); ``tf.saved_model.load`` and the partial import register them again, and the
revived layer trains as the original does. Where TensorFlow cannot save one (it captures
what a SavedModel cannot hold), or in a file written before gradients were saved, the
record says so (``SAVED_KEY``) and a revived layer refuses a training call with a
``RevivedCallError`` saying why; with its class importable, it trains as usual.
"""

from __future__ import annotations

from typing import Any

from trainer.errors import RevivedCallError

RECORD_KEY = "python_gradient"
# Whether the SavedModel holds those gradient functions (absent in older files: no).
SAVED_KEY = "python_gradient_saved"
# The ValueErrors TensorFlow raises where it cannot save a traced gradient function, by
# their messages (``_trace_gradient_functions`` and ``_iterate_op_types`` in
# tensorflow/python/saved_model/save.py, TensorFlow 2.21): only these make the save go on
# without the gradients. Any other ValueError is the save's own failure and surfaces as is;
# saving again without the gradients would only repeat it and blame the gradients.
_UNSAVEABLE_GRADIENT_MESSAGES = (
    "Error when tracing gradients for SavedModel",
    "when saving custom gradients",  # "Found invalid capture ... when saving custom ..."
    "Cannot save custom gradient",
    "Unable to save gradient functions",
)


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


def unsaveable(error: BaseException) -> bool:
    """Whether ``error``, raised by ``tf.saved_model.save`` with custom gradients on, is
    TensorFlow refusing a gradient function (one that captures what a SavedModel cannot
    hold), rather than anything else going wrong in the save."""
    message = str(error)
    return isinstance(error, ValueError) and any(
        known in message for known in _UNSAVEABLE_GRADIENT_MESSAGES
    )


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


def marked(records: list[dict[str, Any] | None]) -> bool:
    """Whether any layer's traces use a Python gradient (after ``propagate``)."""
    return any(record and record.get(RECORD_KEY) for record in records)


def set_saved(records: list[dict[str, Any] | None], saved: bool) -> None:
    """Record in every marked layer whether the SavedModel holds its gradient functions."""
    for record in records:
        if record and record.get(RECORD_KEY):
            record[SAVED_KEY] = saved


def trainable_when_revived(record: dict[str, Any]) -> bool:
    """Whether a layer revived from its traces can train: its traces use no Python
    gradient, or the SavedModel holds the traced gradient functions."""
    return not record.get(RECORD_KEY) or bool(record.get(SAVED_KEY))


def refuse_training(layer: Any) -> RevivedCallError:
    return RevivedCallError(
        f"Layer {layer.name!r} ({type(layer).__name__}) was revived from its traced "
        f"functions (its class was not available at load time), and its call takes its "
        f"gradient from Python (tf.custom_gradient), which this SavedModel does not hold "
        f"(saved before trainer saved traced gradients, or TensorFlow could not trace it: "
        f"see the save's log): it predicts as saved, but cannot be trained. Make its class "
        f"importable (keras.saving.register_keras_serializable, or custom_objects) to "
        f"train it, or call it with training=False. Received: training=True"
    )
