"""Which traced function a layer revived from its traces runs for one call.

A traced function takes tensors of the specs it was traced with, and every plain Python
argument (``scale=5.0``, ``use_bias=False``) only at the value it was traced with: the
value is baked into its graph. A layer shared in a graph (``sa(x)`` and ``sa(x, scale=5.0)``)
has one trace per set of values, and a call runs the trace whose Python values are the
call's, an argument left out standing for its default in the original ``call``'s signature
(on both sides: a trace of ``sa(x)`` is the one for ``sa(x, scale=2.0)``). The call is then
passed on in the layout that trace was recorded with, so TensorFlow finds it. No trace with
the call's Python values: the call is refused (the original would have computed something
no trace holds), naming the values each trace was made with.
"""

from __future__ import annotations

import inspect
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.errors import RevivedCallError
from trainer.save_backends.savedmodel.features import masks

# The default of a parameter whose default is not a plain value (a tuple, an object): it
# matches only a trace that also left the argument out.
OPAQUE = object()

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _is_tensor(value: Any) -> bool:
    if isinstance(value, tf.TypeSpec | np.ndarray | keras.KerasTensor | keras.Variable):
        return True
    return tf.is_tensor(value) or isinstance(value, tf.Variable)


def _has_tensor(value: Any) -> bool:
    return any(_is_tensor(x) for x in tf.nest.flatten(value))


def _slots(
    signature: inspect.Signature, args: Any, kwargs: dict[str, Any], opaque: set[str]
) -> dict[str, Any] | None:
    """Every argument of a call by name (extra positionals as ``*0``, ``*1``...), defaults
    filled in; None if the signature does not take the call."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    slots: dict[str, Any] = {}
    for name, parameter in signature.parameters.items():
        if name not in bound.arguments:
            if parameter.kind in _POSITIONAL or parameter.kind is parameter.KEYWORD_ONLY:
                default = parameter.default
                plain = default is not parameter.empty and name not in opaque
                slots[name] = default if plain else OPAQUE if name in opaque else None
            continue
        value = bound.arguments[name]
        if parameter.kind is parameter.VAR_POSITIONAL:
            slots.update({f"*{i}": item for i, item in enumerate(value)})
        elif parameter.kind is parameter.VAR_KEYWORD:
            slots.update(value)
        else:
            slots[name] = value
    slots.pop("training", None)
    return slots


def _positional_names(signature: inspect.Signature, count: int) -> list[str]:
    names = [n for n, p in signature.parameters.items() if p.kind in _POSITIONAL]
    return (names + [f"*{i}" for i in range(count)])[:count]


def _all_none(value: Any) -> bool:
    return all(x is None for x in tf.nest.flatten(value))


def _same_plain(given: Any, traced: Any) -> bool:
    """Whether a Python value equals the one a trace was made with (lists and tuples alike:
    a graph rebuilt from its JSON config passes lists; ``True`` is not ``1``)."""
    if given is OPAQUE or traced is OPAQUE:
        return given is traced
    if _all_none(given) and _all_none(traced):
        return True
    if isinstance(given, list | tuple) and isinstance(traced, list | tuple):
        return len(given) == len(traced) and all(map(_same_plain, given, traced))
    if isinstance(given, dict) and isinstance(traced, dict):
        keys = given.keys() == traced.keys()
        return keys and all(_same_plain(given[k], traced[k]) for k in given)
    if isinstance(given, bool) != isinstance(traced, bool):
        return False
    try:
        return bool(type(given) is type(traced) or isinstance(given, int | float)) and bool(
            given == traced
        )
    except Exception:  # an object whose == does not answer a bool
        return False


def _matches(given: dict[str, Any], traced: dict[str, Any]) -> bool:
    """Same Python values, and tensors where the trace took tensors (their specs are
    TensorFlow's to match); a missing argument is ``None``."""
    for name in given.keys() | traced.keys():
        value, spec = given.get(name), traced.get(name)
        if _has_tensor(value) or _has_tensor(spec):
            if not (_has_tensor(value) and _has_tensor(spec)):
                return False
        elif not _same_plain(value, spec):
            return False
    return True


def traces(function: Any, signature: inspect.Signature, opaque: set[str]) -> list[Any]:
    """``(positional names, keyword names, slots)`` of each trace of ``function`` (masks
    left out), each layout once."""
    found, seen = [], set()
    for concrete in tf_compat.concrete_functions(function) if function is not None else []:
        args, kwargs = concrete.structured_input_signature[0]
        kwargs = {k: v for k, v in dict(kwargs).items() if k != masks.KEY}
        slots = _slots(signature, tuple(args), kwargs, opaque)
        if slots is None:
            continue
        layout = (tuple(_positional_names(signature, len(args))), tuple(sorted(kwargs)))
        key = (layout, repr({k: v for k, v in slots.items() if not _has_tensor(v)}))
        if key not in seen:
            seen.add(key)
            found.append((*layout, slots))
    return found


def arrange(
    layer: Any, function: Any, args: Any, kwargs: dict[str, Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The call ``(args, kwargs)`` in the layout of each trace with its Python values, the
    Python values as traced; ``[(args, kwargs)]`` as given if the layer's signature is not
    known to bind the traces (records written without one); RevivedCallError if none
    matches."""
    signature = live_objects.get_marker(layer, live_objects.CALL_SIGNATURE)
    opaque = live_objects.get_marker(layer, live_objects.OPAQUE_DEFAULTS)
    recorded = traces(function, signature, opaque)
    given = _slots(signature, tuple(args), kwargs, opaque)
    if given is None or not recorded:
        return [(tuple(args), kwargs)]
    arranged = []
    for positional, keywords, slots in recorded:
        if not _matches(given, slots):
            continue

        def pick(name: str, slots: dict[str, Any] = slots) -> Any:
            value = given.get(name)
            return value if _has_tensor(value) else slots.get(name)

        arranged.append((tuple(map(pick, positional)), {k: pick(k) for k in keywords}))
    if not arranged:
        raise unmatched_values(layer, recorded, given)
    return arranged


def _plain(slots: dict[str, Any]) -> str:
    shown = {k: ("<default>" if v is OPAQUE else v) for k, v in slots.items()}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items() if not _has_tensor(v)) or "-"


def _tensor_names(slots: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in slots.items() if _has_tensor(v))


def unmatched_values(layer: Any, recorded: list[Any], given: dict[str, Any]) -> Exception:
    """The error for a call whose Python argument values (or which arguments get tensors)
    no trace was made with."""
    made = "; ".join(
        f"({_plain(s)}; tensors for {', '.join(_tensor_names(s))})" for *_, s in recorded
    )
    return RevivedCallError(
        f"Layer {layer.name!r} ({type(layer).__name__}) was revived from its traced functions "
        f"(its class was not available at load time), and none of them was traced with "
        f"these Python argument values, or with tensors for these arguments: a traced "
        f"function computes with the Python values (numbers, flags, strings) it was "
        f"traced with only. Its traces were made with {made[:1000]}. Call it with the "
        f"values of one of them (an argument left out stands for its default), or make its "
        f"class importable to load it from its config. Received: {_plain(given)}; tensors "
        f"for {', '.join(_tensor_names(given)) or 'none'}"
    )
