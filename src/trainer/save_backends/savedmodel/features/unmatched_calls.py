"""The error for a call of a revived layer that none of its traced functions takes.

A traced function takes only the kinds of tensors (dense, ragged, sparse), ranks, dtypes
and shapes it was traced with (``None``: any size). TensorFlow's own refusal lists every
trace in full; the user needs to know *which* of those differs from what they passed, and
what the traces accept, with TensorFlow's error kept as the cause.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import tensorflow as tf_compat
from trainer.errors import RevivedCallError

# The difference that gets the advice on declaring a subclassed model's input dtypes.
_DTYPE = "dtype"


def _kind(spec: Any) -> str:
    if isinstance(spec, tf.RaggedTensorSpec):
        return "ragged"
    if isinstance(spec, tf.SparseTensorSpec):
        return "sparse"
    return "dense"


def _described_kind(spec: Any) -> str:
    if isinstance(spec, tf.RaggedTensorSpec):
        return f"ragged (ragged_rank {spec.ragged_rank})"
    return _kind(spec)


def _spec(value: Any) -> Any:
    return tf.type_spec_from_value(value) if tf.is_tensor(value) else value


def _shape(spec: Any) -> str:
    return str(tuple(spec.shape.as_list())) if spec.shape.rank is not None else "any shape"


def differences(traced: Any, given: Any) -> list[tuple[str, str]]:
    """(what, sentence) for each way the call ``given`` (args, kwargs of specs and Python
    values) differs from one trace's ``traced`` inputs; empty if it would match."""
    want = tf.nest.flatten(traced)
    have = tf.nest.flatten(given)
    want_specs = [x for x in want if isinstance(x, tf.TypeSpec)]
    have_specs = [x for x in have if isinstance(x, tf.TypeSpec)]
    if len(want_specs) != len(have_specs):
        return [("count", f"{len(have_specs)} tensors, where it takes {len(want_specs)}")]
    found: list[tuple[str, str]] = []
    for i, (w, h) in enumerate(zip(want_specs, have_specs, strict=True)):
        if _kind(w) != _kind(h):
            found.append(("kind", f"input {i} is {_kind(h)}, where it takes {_kind(w)}"))
        elif _kind(w) == "ragged" and w.ragged_rank != h.ragged_rank:
            found.append(
                (
                    "kind",
                    f"input {i} has ragged_rank {h.ragged_rank}, where it takes {w.ragged_rank}",
                )
            )
        elif w.dtype != h.dtype:
            found.append((_DTYPE, f"input {i} is {h.dtype.name}, where it takes {w.dtype.name}"))
        elif w.shape.rank is not None and h.shape.rank != w.shape.rank:
            found.append(
                ("rank", f"input {i} has shape {_shape(h)}, where it takes {_shape(w)} (rank)")
            )
        elif not w.shape.is_compatible_with(h.shape):
            found.append(("shape", f"input {i} has shape {_shape(h)}, where it takes {_shape(w)}"))
    return found


def _traces(function: Any) -> list[Any]:
    if function is None:
        return []
    return [c.structured_input_signature[0] for c in tf_compat.concrete_functions(function)]


def unmatched_call(layer: Any, function: Any, args: Any, kwargs: Any, err: Exception) -> Exception:
    """The error for a call of ``layer`` that no traced ``function`` takes: what differs
    from each trace, the inputs the traces take, TensorFlow's own first line; ``err``
    kept as its cause (``raise ... from err``) and as ``tensorflow_error`` (Keras' call
    wrapper drops causes, ``keras_compat.raised_as_is``)."""
    given = tf.nest.map_structure(_spec, (tuple(args), kwargs))
    traces = _traces(function)
    found = [differences(t, given) for t in traces]
    described = []
    for number, (trace, diffs) in enumerate(zip(traces, found, strict=True), 1):
        accepts = ", ".join(
            f"{_described_kind(s)} {s.dtype.name} {_shape(s)}"
            for s in tf.nest.flatten(trace)
            if isinstance(s, tf.TypeSpec)
        )
        what = "; ".join(d for _, d in diffs) or "its tensors match: see TensorFlow's error"
        described.append(f"trace {number} takes [{accepts}]: {what}")
    advice = ""
    if any(what == _DTYPE for diffs in found for what, _ in diffs):
        advice = (
            " A subclassed model is traced on the inputs Keras records for it, shapes only, "
            "in its input dtype, or in the integer dtypes its ops show it takes: one called "
            "on other dtypes revives only with its class, or declare them before saving "
            "(self.input_spec = keras.InputSpec(dtype=...)), or build it as a Functional "
            "model on keras.Input(dtype=...)."
        )
    # TensorFlow's first line says what failed; the rest lists every trace in full.
    first_line = (str(err).strip().splitlines() or [""])[0].removesuffix("Got:").strip()
    error = RevivedCallError(
        f"Layer {layer.name!r} ({type(layer).__name__}) was revived from its traced functions "
        f"(its class was not available at load time), and none of them takes these "
        f"arguments: {'; '.join(described)[:1500]}. A traced function takes only the kind "
        f"of tensors (dense, ragged or sparse), rank, dtype and shape (None: any size) it "
        f"was traced with: call it with inputs one of its traces takes, or make its class "
        f"importable to load it from its config (which takes what the original took)."
        f"{advice} TensorFlow's error: {type(err).__name__}: {first_line[:300]} "
        f"Received: args={repr(given[0])[:500]}, kwargs={repr(given[1])[:300]}"
    )
    error.tensorflow_error = err
    return keras_compat.raised_as_is(error)
