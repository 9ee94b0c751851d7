"""How a backend is named: in the start-of-training log line (its ``repr``) and in
checkpoints, registries and entry points (``module:Qualified.Name``).

No Keras or TensorFlow here: the registry names classes it has not imported.
"""

from __future__ import annotations

import inspect
from typing import Any

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def constructor_repr(backend: object) -> str:
    """``H5Backend()``, ``H5Backend(compression='gzip')``: the class and the constructor
    arguments that differ from their defaults (read from the attributes of the same
    name). The start-of-training log line shows the backend, wrappers included
    (``AsyncBackend(SavedModelBackend())``); object's default was an address."""
    try:
        parameters = inspect.signature(type(backend).__init__).parameters.values()
    except (TypeError, ValueError):  # a C-level or otherwise unreadable constructor
        parameters = ()
    shown = []
    for parameter in parameters:
        if parameter.name == "self" or parameter.kind in _VARIADIC:
            continue
        if parameter.name not in vars(backend):  # not kept under its own name: not shown
            continue
        value = vars(backend)[parameter.name]
        if not _is_default(value, parameter.default):
            shown.append(f"{parameter.name}={value!r}")
    return f"{type(backend).__name__}({', '.join(shown)})"


def _is_default(value: Any, default: Any) -> bool:
    """Whether a constructor argument kept as ``value`` is its ``default`` (an argument
    without a default, or one whose ``==`` does not give a bool, is shown)."""
    if default is inspect.Parameter.empty:
        return False
    try:
        return bool(value is default or value == default)
    except Exception:  # e.g. an array's ambiguous truth value
        return False


def class_path(cls: type) -> str:
    """``"module:Qualified.Name"``: how ``register_backend`` and entry points name a class."""
    return f"{cls.__module__}:{cls.__qualname__}"
