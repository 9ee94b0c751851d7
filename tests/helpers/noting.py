"""A subclassed model whose inner layer notes every input its ``call`` runs on, to check
what a SavedModel save traces: on what the save really does, not on how long it takes.

Shared by the tests of the input forms a first save tries
(``tests/save_backends/savedmodel/save/test_tries_follow_calls.py``) and of the copies
``trainer.wrapping`` makes (``tests/wrapping/test_copies_keep_call_records.py``); the
layer they build on (``AroundDense``) is the hook-error tests' too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

PKG = "noting"

# (kind, dtype) of what a ``Noting`` layer's ``call`` ran on inside ``noting()`` (module
# state: an attribute of the layer would be layer state the save checks).
_NOTED: set[tuple[str, str]] | None = None


@contextlib.contextmanager
def noting() -> Iterator[set[tuple[str, str]]]:
    """The (type name, dtype name) of every input a ``Noting`` layer's ``call`` runs on in
    this block: ``("SymbolicTensor", "float32")`` for a dense float trace,
    ``("SparseTensor", ...)``, ``("RaggedTensor", ...)`` for the other forms."""
    global _NOTED
    _NOTED = noted = set()
    try:
        yield noted
    finally:
        _NOTED = None


class AroundDense(keras.layers.Layer):
    """A custom layer around one ``Dense(2)`` (so it takes dense, sparse and ragged
    inputs), for tests to instrument: ``Noting`` notes its inputs, the hook-error tests'
    ``Hooked`` fails in its save and load hooks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, inputs):
        return self.dense(inputs)


@keras.saving.register_keras_serializable(PKG)
class Noting(AroundDense):
    """Notes the kind and dtype of every input its ``call`` runs on (``noting``)."""

    def call(self, inputs):
        if _NOTED is not None:
            _NOTED.add((type(inputs).__name__, inputs.dtype.name))
        return super().call(inputs)


@keras.saving.register_keras_serializable(PKG)
class DenseNet(keras.Model):
    """A subclassed model around one ``Noting`` layer: Keras records the shapes of its
    calls only, so the save chooses the input forms to try from ``call_records``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Noting()

    def build(self, input_shape):  # what ``model.build`` then builds without a call
        self.inner.build(input_shape)

    def call(self, inputs):
        return self.inner(inputs)
