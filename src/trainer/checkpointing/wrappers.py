"""Backends around a backend: one pattern for everything that changes *how* a save runs.

A ``WrappingBackend`` holds an ``inner`` backend and delegates everything it does not change
(``name``, ``load``, ``checkpoint_path``, ``read_metadata``...), so the manager, listings and
loads treat it as the backend it wraps. ``AsyncBackend`` writes in a background thread;
``trainer.distribute.ScratchBackend`` (a non-chief worker's saves) writes and removes. They
nest: ``AsyncBackend(ScratchBackend(WeightsBackend()))``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from trainer.checkpointing.snapshot import (
    AsyncWriter,
    all_variables,
    clone_for_snapshot,
    refresh_snapshot,
    variable_copier,
)
from trainer.save_backends.base import SaveBackend


class WrappingBackend:
    """Delegates to ``inner``; subclasses override ``save`` (and ``wait`` / ``close``)."""

    def __init__(self, inner: SaveBackend | WrappingBackend):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def save(self, model: keras.Model, path: str | Path, **kwargs: Any) -> Path:
        return Path(self.inner.save(model, path, **kwargs))

    def wait(self) -> None:
        """Return once every write handed to this backend is finished (raises a failure)."""
        wait = getattr(self.inner, "wait", None)
        if wait is not None:
            wait()

    def close(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


def innermost(backend: Any) -> SaveBackend:
    """The real backend under any number of wrappers."""
    while isinstance(backend, WrappingBackend):
        backend = backend.inner
    return backend


class AsyncBackend(WrappingBackend):
    """Writes through ``inner`` in a background thread while training goes on.

    ``save`` copies every variable of the model into a shadow model (built once, on the
    first save) synchronously, then writes the shadow in the background: what is written is
    the state at the moment of the call. At most one write is in flight (the next ``save``
    waits); a failed write is raised by the next ``save``, ``wait`` or ``close``, never lost.
    """

    def __init__(self, inner: SaveBackend | WrappingBackend):
        super().__init__(inner)
        self.writer = AsyncWriter()
        self._shadow: keras.Model | None = None
        self._source: keras.Model | None = None
        self._copier: Callable[[], None] | None = None
        self._copied: tuple[int, ...] = ()  # ids of the variables the copier assigns

    def save(self, model: keras.Model, path: str | Path, **kwargs: Any) -> Path:
        target = Path(self.inner.checkpoint_path(path))
        self.submit(model, lambda snapshot: self.inner.save(snapshot, target, **kwargs))
        return target

    def submit(self, model: keras.Model, job: Callable[[keras.Model], Any]) -> None:
        """Run ``job(snapshot)`` in the background, ``snapshot`` holding ``model``'s state now.

        The traced copy is built in the background after the first write (tracing it costs
        more than one eager copy), so the first save copies variable by variable."""
        self.writer.wait()  # one write in flight; raises an earlier failure
        snapshot = self.snapshot(model)
        current = tuple(id(v) for v in all_variables(model))
        trace = current != self._copied

        def run():
            job(snapshot)
            if trace and current == tuple(id(v) for v in all_variables(model)):
                # Read by the next snapshot only after ``writer.wait()``: no race.
                self._copier, self._copied = variable_copier(model, snapshot), current

        self.writer.submit(run)

    def snapshot(self, model: keras.Model) -> keras.Model:
        """The shadow model (built once per source model), brought to ``model``'s state."""
        if self._shadow is None or self._source is not model:
            self._shadow, self._source = clone_for_snapshot(model), model
            self._copier, self._copied = None, ()
        if tuple(id(v) for v in all_variables(model)) != self._copied:
            self._copier, self._copied = None, ()  # variables created since: copy eagerly
        refresh_snapshot(model, self._shadow, self._copier)
        return self._shadow

    def wait(self) -> None:
        self.writer.wait()
        super().wait()
