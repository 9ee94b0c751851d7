"""What a subclassed model was called on: the kinds (dense, sparse, ragged) and dtypes of
its inputs, recorded at each call.

Why: Keras records only the shapes of a subclassed model's calls (``_build_shapes_dict``),
so the SavedModel backend cannot tell a model called on sparse features, ragged rows or
16-bit images from one called on dense float32 tensors, and used to trace every such form
on every first save (each a throwaway trace of the whole model, and every form the model
runs on kept and traced again per layer): a Dense MLP called on floats paid for sparse and
ragged forms it never saw. With a record, the save tries only what the model was called
on; without one it still tries everything.

How: Keras has no public hook on calls, so ``install`` replaces ``Layer.__call__`` (what
every model runs; ``keras.Model`` has none of its own) by one that notes a model's
inputs and runs Keras's. On ``Layer`` itself, not on ``Model``: trainer tells a class
that overrides ``__call__`` by the class defining it (``readiness.overrides_call``,
``tracing.converts_before_call``), and that must stay Keras's ``Layer`` for every model.
It runs for every model (sub-models too), eagerly and
while a ``tf.function`` traces (``fit``'s train function on the data's real specs), never
in a traced graph's runs. A record is complete only if it starts with the model's first
call (the model not yet built): a model called before ``install``, or built by
``build()``/from a config, has none that can be trusted. The save's own throwaway traces
call the model on forms it tries; ``paused`` keeps those out. Checked: Keras 3.15.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from trainer._compat.keras import sublayers

_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INSTALLED: set = set()  # the replacement, once installed
_PAUSED = threading.local()  # per thread: an async save traces in its own thread


@dataclasses.dataclass
class CallRecord:
    """The input kinds (``"dense"``, ``"sparse"``, ``"ragged"``) and dtype names of every
    call of one model. ``complete``: the record started with the model's first call and
    every input leaf was a tensor or array (else what the model saw is not all known)."""

    kinds: set[str] = dataclasses.field(default_factory=set)
    dtypes: set[str] = dataclasses.field(default_factory=set)
    complete: bool = True


def install() -> None:
    """Record the inputs of every later call of a ``keras.Model``. Idempotent."""
    layer_class = keras.layers.Layer
    inherited = layer_class.__call__
    if inherited in _INSTALLED:
        return

    @functools.wraps(inherited)
    def __call__(self, *args, **kwargs):
        if isinstance(self, keras.Model) and not getattr(_PAUSED, "depth", 0):
            _note(self, args, kwargs)
        return inherited(self, *args, **kwargs)

    layer_class.__call__ = __call__
    _INSTALLED.add(__call__)


def recorded(model: keras.Model) -> CallRecord | None:
    """The complete record of what ``model`` was called on; None if there is none."""
    record = _RECORDS.get(model)
    return record if record is not None and record.complete else None


def share(model: keras.Model, copy: keras.Model) -> None:
    """Let ``copy`` (rebuilt from ``model``'s config: built, so without a record of its
    own) have ``model``'s record, the same object: the calls ``model`` gets later (its
    ``fit``) are the copy's too. An async save writes the copy, and without a record its
    first save would try every input form."""
    record = _RECORDS.get(model)
    # No record of the model's calls: none of the copy's (its own calls are not the model's).
    _RECORDS[copy] = record if record is not None else CallRecord(complete=False)


def share_nested(model: keras.Model, copy: keras.Model) -> None:
    """``share`` for ``copy`` and each of its sub-models, paired with ``model``'s in
    Keras's order: a copy of a model holding a subclassed model (``trainer.wrapping``'s
    host of one) gives it back as the model to save. Nothing is shared unless both hold
    models of the same classes in the same order."""
    originals = [model, *(m for m in sublayers(model) if isinstance(m, keras.Model))]
    copies = [copy, *(m for m in sublayers(copy) if isinstance(m, keras.Model))]
    if [type(m) for m in originals] != [type(m) for m in copies]:
        return  # not the same models in the same order: no record is known to belong
    for original, copied in zip(originals, copies, strict=True):
        share(original, copied)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Calls in this block (this thread) are not recorded: a save's tries of forms the
    model was never called on must not count as calls."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


def _note(model: keras.Model, args: tuple, kwargs: dict) -> None:
    try:
        record = _RECORDS.get(model)
    except TypeError:  # not weakly referenceable: nothing to record on
        return
    if record is None:
        record = _RECORDS[model] = CallRecord(complete=not model.built)
    if not record.complete:
        return
    positional = tf.nest.flatten(args, expand_composites=False)
    keyword = [x for x in tf.nest.flatten(kwargs, expand_composites=False) if _form(x)]
    for leaf in positional + keyword:
        form = _form(leaf)
        if form is None:
            if leaf is not None:  # a Python number or string: its dtype is Keras's choice
                record.complete = False
            continue
        record.kinds.add(form[0])
        record.dtypes.add(form[1])


def _form(value: Any) -> tuple[str, str] | None:
    """(kind, dtype name) of a tensor-like input; None for anything else."""
    if isinstance(value, tf.SparseTensor):
        return "sparse", value.dtype.name
    if isinstance(value, tf.RaggedTensor):
        return "ragged", value.dtype.name
    if isinstance(value, keras.KerasTensor):  # a symbolic call (a Functional model's build)
        kind = "sparse" if value.sparse else "ragged" if value.ragged else "dense"
        return kind, keras.backend.standardize_dtype(value.dtype)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return None
    try:
        return "dense", keras.backend.standardize_dtype(dtype)
    except ValueError:  # a dtype Keras does not know (a NumPy object array)
        return None
