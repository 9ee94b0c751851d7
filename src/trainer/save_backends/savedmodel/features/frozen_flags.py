"""Whether a revived layer's training trace still computes what its layers would now.

A layer revived from its traces trains with the function traced at save, and Keras'
``BatchNormalization`` read its ``trainable`` flag while that was traced: a frozen one
normalizes with its moving statistics and leaves them alone even with ``training=True``
(the transfer-learning pattern), a trainable one uses the batch's and updates them. Set
after the load, the flag cannot change the traced graph, and the block would train as it
was saved, silently. So the flags each such layer had when revived are kept, and a training
call after one of them changed is refused, naming the layer.
"""

from __future__ import annotations

from typing import Any

import keras

from trainer._compat import keras as keras_compat
from trainer.errors import RevivedCallError

# Keras layers whose call reads ``self.trainable``.
_READS_TRAINABLE = (keras.layers.BatchNormalization,)


def snapshot(layer: keras.layers.Layer) -> list[tuple[Any, bool]]:
    """``(sublayer, trainable)`` of the sublayers at any depth whose call reads it."""
    found = keras_compat.sublayers(layer, include_self=False, recursive=True)
    return [(x, bool(x.trainable)) for x in found if isinstance(x, _READS_TRAINABLE)]


def check(layer: keras.layers.Layer, traced: list[tuple[Any, bool]]) -> None:
    """RevivedCallError if a training call would run a trace recorded with other flags."""
    changed = [(x, flag) for x, flag in traced if bool(x.trainable) != flag]
    if not changed:
        return
    named = ", ".join(f"{x.name!r} trainable={flag}" for x, flag in changed)
    now = ", ".join(f"{x.name!r} trainable={bool(x.trainable)}" for x, _ in changed)
    raise RevivedCallError(
        f"Layer {layer.name!r} ({type(layer).__name__}) was revived from its traced functions "
        f"(its class was not available at load time), and its training trace was recorded "
        f"with {named}. A frozen BatchNormalization keeps its moving statistics and a "
        f"trainable one uses the batch's, which the trace cannot change: it would train as "
        f"saved. Set the flags back, call it with training=False, or make its class "
        f"importable (or freeze it before saving). Received: {now}"
    )
