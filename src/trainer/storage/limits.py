"""Bounds on what a checkpoint may ask the loader to do, checked before anything is built.

A checkpoint is untrusted input: its JSON could nest deep enough to exhaust the stack, or
ask for a ``Dense(units=10**12)`` whose variables would take the machine's memory before
any shape check runs. These checks refuse such input with ``CorruptCheckpointError``.

The dimension bound scales with the checkpoint: no layer dimension can legitimately exceed
the number of bytes of stored weights (each dimension unit owns at least one stored
parameter), with a floor of 2**24 for inputs such as long sequences that own no weights.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.errors import CorruptCheckpointError

MAX_JSON_BYTES = 256 << 20  # one stored JSON document (config, metadata)
MAX_DEPTH = 100  # nesting of dicts and lists; real Keras configs stay below 30
DIMENSION_FLOOR = 1 << 24
_dimension_cap: contextvars.ContextVar[int] = contextvars.ContextVar(
    "dimension_cap", default=DIMENSION_FLOOR
)


@contextlib.contextmanager
def dimension_budget(stored_bytes: int) -> Iterator[None]:
    """While loading a checkpoint of ``stored_bytes``, bound config integers accordingly."""
    token = _dimension_cap.set(max(DIMENSION_FLOOR, int(stored_bytes)))
    try:
        yield
    finally:
        _dimension_cap.reset(token)


def check_text_size(size: int, what: str, where: Path | str) -> None:
    if size > MAX_JSON_BYTES:
        raise CorruptCheckpointError(
            f"{where}: the stored {what} is {size} bytes, over the {MAX_JSON_BYTES}-byte "
            f"limit for one JSON document; the checkpoint is damaged or crafted. Load an "
            f"older checkpoint. Received size {size}"
        )


def check_structure(value: Any, what: str, where: Path | str, *, dimensions: bool) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` and, for architectures (``dimensions``),
    integers larger than the checkpoint could hold weights for (keys naming seeds aside)."""
    cap = _dimension_cap.get()
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, key = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(
                f"{where}: the stored {what} nests deeper than {MAX_DEPTH} levels; no real "
                f"model needs that, so the checkpoint is damaged or crafted. Load an older "
                f"checkpoint. Received depth > {MAX_DEPTH}"
            )
        if isinstance(item, dict):
            stack.extend((v, depth + 1, str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, depth + 1, key) for v in item)
        elif dimensions and type(item) is int and abs(item) > cap and "seed" not in key.lower():
            raise CorruptCheckpointError(
                f"{where}: the stored {what} asks for {key}={item}, more than the {cap} "
                f"this checkpoint's stored weights could fill; building it would exhaust "
                f"memory, so the checkpoint is refused as damaged or crafted. Received "
                f"{key}={item}"
            )
