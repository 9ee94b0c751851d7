"""Loops in traced functions that train both eagerly and in a ``tf.function``.

A layer revived from its traced functions trains through those functions. When one of
them runs a ``tf.while_loop`` over variables (an RNN: a user layer holding an ``LSTM``,
Keras's ``ConvLSTM`` base class), TensorFlow needs to know the dtype behind each variable
handle the loop passes through, and a function loaded from a SavedModel lacks it on the
loop's outputs. The first way TensorFlow differentiated such a function worked; the
second (an eager training step, ``compile(run_eagerly=True)``, then ``fit`` in a
``tf.function``, or the other way round, or a persistent tape after a plain one) failed
inside every later training step with ``ValueError: Internal error: Tried to take
gradients (or similar) of a variable without handle data``. The loaded functions get
that information back as soon as their layer is revived, before anything runs them.
"""

from __future__ import annotations

from typing import Any

from trainer._compat import tensorflow as tf_compat

# Every function of a layer's node that a training step can differentiate.
_FUNCTIONS = ("call_infer", "call_train", "call_default", "compute_mask")


def prepare(node: Any) -> None:
    """Complete the loops of every traced function of ``node`` (a revived layer's loaded
    node) and of the functions they call (children's traces, nested ``tf.function``s)."""
    functions = [getattr(node, name, None) for name in _FUNCTIONS]
    functions += list(getattr(node, "regularizer_functions", None) or [])
    for function in functions:
        if function is not None:
            tf_compat.restore_loop_handle_data(function)
