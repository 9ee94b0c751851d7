"""Telling "this class cannot be rebuilt" apart from "this checkpoint is damaged".

Rebuilding a model from its stored config runs the stored classes' own code: their
``from_config``, constructor, ``build`` and, for a functional graph, ``call``. When that code
raises on a readable checkpoint, the class is at fault, not the file, and calling it damage
sends the user hunting for a bad disk instead of fixing ``get_config`` / ``from_config``.
Keras raises ``TypeError`` for such a class; so do we (:class:`RebuildError`), naming the
class, the method that failed and its own error.

Keras's own classes rebuild from the configs they write, so when only they are involved the
config itself is wrong: :func:`rebuild_error` returns None and the caller reports damage.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

from trainer.errors import RebuildError

# Keras's TypeError for a class it found but that has no from_config (serialization_lib).
_NO_FROM_CONFIG = re.compile(r"Unable to reconstruct an instance of '([^']+)'[^.]*")
# Packages whose classes are not the user's: Keras's own classes round-trip their configs,
# and trainer's stand-ins are ours. Keras ships its test modules inside the package; the
# classes they define are user code like any other (their module ends in "_test").
_OWN_PACKAGES = frozenset({"keras", "tensorflow", "tf_keras", "trainer"})
_MAX_TEXT = 500


def rebuild_error(error: BaseException, where: object, what: str) -> RebuildError | None:
    """The :class:`RebuildError` for ``error`` raised while deserializing ``what``, or None
    if no user class's code is at fault (then the config itself is damaged)."""
    missing = _NO_FROM_CONFIG.search(str(error))
    if missing:
        name = missing.group(1)
        problem = missing.group(0)  # Keras's words, wherever in the chain of messages
    else:
        found = _failing_class(error)
        if found is None:
            return None
        cls, method = found
        name = cls.__name__
        cause = _innermost(error)
        problem = (
            f"{cls.__module__}.{cls.__qualname__}.{method}() raised "
            f"{type(cause).__name__}: {_summary(cause)}"
        )
    return RebuildError(
        f"{where}: the stored {what} could not be rebuilt from its config because of class "
        f"{name!r}: {problem}. The checkpoint was read, but this class fails to rebuild "
        f"from the config it saved. Give {name} a get_config() returning its "
        f"constructor arguments and a from_config() rebuilding it from them (layers or other "
        f"Keras objects it holds must be deserialized there, with "
        f"keras.saving.deserialize_keras_object), or pass the class matching the checkpoint "
        f"in custom_objects={{{name!r}: cls}}. "
        f"Received: {type(error).__name__}: {_summary(error)}"
    )


def method_error(error: BaseException, model: Any, method: str, where: object) -> RebuildError:
    """A model's own ``method`` (``compile_from_config``) raised while loading."""
    name = type(model).__name__
    return RebuildError(
        f"{where}: {name}.{method}() raised {type(error).__name__} while the model was "
        f"compiled as saved. The checkpoint was read; fix {name}.{method}() (it receives "
        f"what {name}.get_compile_config() returned at save time), or load with "
        f"compile=False and compile the model yourself. "
        f"Received: {type(error).__name__}: {_summary(error)}"
    )


def _failing_class(error: BaseException) -> tuple[type, str] | None:
    """The innermost user class (not Keras's, not trainer's) whose method was running when
    ``error`` (or an exception it was raised from) was raised, with that method's name."""
    found = None
    for frame in _frames(error):
        code = frame.f_code
        if code.co_argcount == 0 or code.co_varnames[0] not in ("self", "cls"):
            continue
        owner = frame.f_locals.get(code.co_varnames[0])
        cls = owner if inspect.isclass(owner) else type(owner)
        if _is_user_serializable(cls):
            found = (cls, code.co_name)
    return found


def _is_user_serializable(cls: type) -> bool:
    if not (hasattr(cls, "from_config") or hasattr(cls, "get_config")):
        return False  # numpy arrays, dicts, context managers...: not a stored class
    module = getattr(cls, "__module__", "") or ""
    return module.split(".")[0] not in _OWN_PACKAGES or module.endswith("_test")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what it was raised from or during, innermost last."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _frames(error: BaseException) -> Iterator[Any]:
    """Every traceback frame of the chain, outermost first."""
    for exc in _chain(error):
        tb = exc.__traceback__
        while tb is not None:
            yield tb.tb_frame
            tb = tb.tb_next


def _innermost(error: BaseException) -> BaseException:
    *_, last = _chain(error)
    return last


def _summary(error: BaseException) -> str:
    """The message without the full configs Keras appends, on one line, bounded."""
    text = str(error)
    for cut in ("\n\nconfig=", "Full object config:", "\n\nException encountered"):
        text = text.split(cut)[0]
    text = " ".join(text.split())
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."
