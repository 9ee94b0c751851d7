"""Backends around a backend: one pattern for everything that changes *how* a save runs.

A ``WrappingBackend`` is a ``SaveBackend`` holding an ``inner`` backend: every other part of
the contract (``name``, ``load``, ``checkpoint_path``, ``read_metadata``...) reads through to
it, so the manager, listings and loads treat it as the backend it wraps. ``AsyncBackend``
writes in a background thread; ``trainer.training.distribute.ScratchBackend`` (a non-chief
worker's saves) writes and removes. They nest: ``AsyncBackend(ScratchBackend(WeightsBackend()))``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import keras

from trainer.checkpointing import rehearsal
from trainer.checkpointing.shadow import SnapshotUnavailable, all_variables, clone_for_snapshot
from trainer.checkpointing.snapshot import (
    AsyncWriter,
    VariableCopier,
    take_snapshot,
    variable_copier,
)
from trainer.model_state import kit, layer_protocol
from trainer.save_backends.base import SaveBackend

log = logging.getLogger(__name__)


class _Inner:
    """A member of the ``SaveBackend`` contract that a wrapper reads from its ``inner``
    backend. Inherited members would otherwise be the base class's own (its ``suffix``,
    its ``load``), never reaching ``__getattr__``; on the class, the descriptor itself."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, wrapper: WrappingBackend | None, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        return getattr(wrapper.inner, self.name)


def _read_through(cls: type[WrappingBackend]) -> type[WrappingBackend]:
    """Every member of ``SaveBackend`` that ``cls`` does not define itself (nor the write
    lifecycle, which each wrapper answers for) reads through to ``inner``: a member added
    to the contract later reads through too, instead of the base class's default."""
    own = set(vars(cls)) | {"prepare", "submit", "wait", "close"}
    members = set(vars(SaveBackend)) | set(SaveBackend.__annotations__)
    for name in sorted(members - own):
        if not (name.startswith("__") or name.startswith("_abc")):
            setattr(cls, name, _Inner(name))
    return abc.update_abstractmethods(cls)


@_read_through
class WrappingBackend(SaveBackend):
    """A backend around another: the base of ``AsyncBackend`` and the multi-worker
    ``ScratchBackend``.

    Every part of the contract not overridden is the inner backend's; subclasses override
    ``save`` and the write lifecycle (``prepare``, ``submit``, ``wait``, ``close``). The
    manager asks any backend the same ``prepare``, ``submit`` and ``wait``, never which
    wrapper it is.

    Args:
        inner: The backend that writes (itself possibly a wrapper).
    """

    def __init__(self, inner: SaveBackend):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        """What the inner backend has beyond the contract (``reuse_traces``, ...)."""
        if name == "inner":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def save(self, model: keras.Model, path: str | Path, **kwargs: Any) -> Path:
        """Save through the inner backend (see ``SaveBackend.save``).

        Args:
            model: The model.
            path: Where the checkpoint goes.
            **kwargs: ``state`` and ``metadata``, as ``SaveBackend.save`` takes them.

        Returns:
            The checkpoint's path.

        Raises:
            SaveError: The write failed.
            ModelNotReadyError: The inner backend refuses the model.
        """
        return Path(self.inner.save(model, path, **kwargs))

    def prepare(self, model: keras.Model) -> None:
        """Training of ``model`` starts: the inner backend's ``prepare``.

        Args:
            model: The model about to train.
        """
        self.inner.prepare(model)

    def wait(self) -> None:
        """Return once every write handed to this backend is finished.

        Raises:
            SaveError: A write failed.
        """
        self.inner.wait()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


def innermost(backend: Any) -> SaveBackend:
    """The real backend under any number of wrappers.

    Args:
        backend: A backend, wrapped or not.

    Returns:
        The innermost ``SaveBackend`` (``backend`` itself if it wraps nothing).
    """
    while isinstance(backend, WrappingBackend):
        backend = backend.inner
    return backend


class AsyncBackend(WrappingBackend):
    """Writes through ``inner`` in a background thread while training goes on.

    ``save`` copies every variable of the model into a shadow model (built once, on the
    first save) synchronously, then writes the shadow in the background: what is written is
    the state at the moment of the call. At most one write is in flight (the next ``save``
    waits); a failed write is raised by the next ``save``, ``wait`` or ``close``, never lost.
    ``prepare`` (the checkpoint callback calls it when training starts) builds the shadow and
    warms the writes ahead of the first save, outside the checkpoint directory. A model that
    cannot be copied (``SnapshotUnavailable``) is saved synchronously, with one warning.

    Args:
        inner: The backend that writes the shadow.
    """

    writes_in_background: ClassVar[bool] = True

    def __init__(self, inner: SaveBackend):
        super().__init__(inner)
        self.writer = AsyncWriter()
        self._shadow: keras.Model | None = None
        self._source: keras.Model | None = None
        self._copier: VariableCopier | None = None
        # With the copier: the layers whose state is copied through the layer-state
        # protocol (``layer_protocol.own_state_pairs``), found once instead of every save.
        self._own_state: list[tuple[Any, Any]] | None = None
        self._copied: tuple[int, ...] = ()  # ids of the variables the copier assigns
        self._checked: tuple[int, ...] = ()  # ids of the variables last found savable
        # The model no shadow could be built for, and why (``SnapshotUnavailable``): its
        # saves are synchronous; the copy is not tried again for it.
        self._uncopied: tuple[keras.Model | None, SnapshotUnavailable | None] = (None, None)
        self._warned_synchronous: keras.Model | None = None

    def save(self, model: keras.Model, path: str | Path, **kwargs: Any) -> Path:
        """Take a snapshot of ``model`` now and write it in the background.

        Args:
            model: The model.
            path: Where the checkpoint goes.
            **kwargs: ``state`` and ``metadata``, as ``SaveBackend.save`` takes them.

        Returns:
            The path the checkpoint will have once written (``wait`` for it).

        Raises:
            SaveError: The previous background write failed (``DiskFullError``,
                ``SavePermissionError``...).
            ModelNotReadyError: The inner backend refuses the model (checked before the copy).
            LayerStateError: A layer's own state could not be copied into the shadow.
        """
        target = Path(self.inner.checkpoint_path(path))
        self.submit(model, lambda writer, snapshot: writer.save(snapshot, target, **kwargs))
        return target

    def writing_synchronously(self, error: SnapshotUnavailable) -> None:
        """``submit`` found no copy of the model possible: the model is written as it is,
        synchronously. Said once per model, as a warning: async was asked for."""
        if self._warned_synchronous is not self._uncopied[0]:
            self._warned_synchronous = self._uncopied[0]
            log.warning("%s", error)

    def submit(self, model: keras.Model, job: Callable[[SaveBackend, keras.Model], Any]) -> None:
        """Run ``job(self.inner, snapshot)`` in the background, ``snapshot`` holding
        ``model``'s state now; ``job(self.inner, model)`` at once, in the caller's thread,
        when no copy of ``model`` can be made (``writing_synchronously``).

        The traced copy is built by ``prepare`` at the start of training; without it (or
        when the model's variables changed since), this save copies variable by variable
        and the traced copy is built in the background after its write.

        Args:
            model: The model to save.
            job: The save: called with the backend that writes it and the model to write.

        Raises:
            SaveError: The previous background write failed (reported here, at the next
                save, since its own caller has moved on).
        """
        self.writer.wait()  # one write in flight; raises an earlier failure
        current = _variable_ids(model)
        if current != self._checked:  # once per set of variables: refusals are structural
            self._check_savable(model)
            self._checked = current
        try:
            complete = self._refresh(model, current)  # the training thread's whole wait
        except SnapshotUnavailable as error:
            self.writing_synchronously(error)
            job(self.inner, model)
            return
        snapshot, trace, inner = self._shadow, current != self._copied, self.inner

        def run():
            complete()
            job(inner, snapshot)
            if trace:
                self._trace_copier(model, snapshot, current)

        self.writer.submit(run)

    def _check_savable(self, model: keras.Model) -> None:
        """What the backend refuses to save (an unbuilt model, layers revived from traces
        for a config-only backend, ...) is refused here, in the training thread, by the
        ``save`` call that asked for it: in the writer thread it would surface only at the
        next save, after a whole epoch of training with nothing written."""
        check = getattr(innermost(self), "check_savable", None)
        if check is not None:
            check(model)

    def prepare(self, model: keras.Model) -> None:
        """Build the shadow of ``model`` now and, in the background, pay the work its first
        writes would (the traced copy; for a backend that caches traces, a rehearsal write
        outside the checkpoint directory), so that the first saves of the run only copy and
        write. Called at the start of training: that work then overlaps the first epoch
        instead of holding the first save (the shadow) and the second (the first write's
        trace). Best effort: anything that fails here is left to the first real save,
        which does the same work and reports its failure.

        Args:
            model: The model about to train.

        Raises:
            SaveError: A background write handed over before failed.
        """
        self.writer.wait()
        prepared = self._source is model and self._copier is not None
        if prepared and self._copied == _variable_ids(model):
            return  # an earlier fit (or save) of this model did it all already
        try:
            _build_optimizer(model)
            current = _variable_ids(model)
            self._refresh(model, current)()
            shadow = self._shadow
        except Exception as error:  # e.g. a model not built yet: the first save retries
            log.info("Async checkpointing not prepared before the first save: %s", error)
            self._shadow = self._source = None
            return
        real = innermost(self)

        def warm():
            if rehearsal.worth_rehearsing(real):
                try:
                    rehearsal.rehearse(self.inner, shadow, real)
                except Exception as error:  # the first real save traces and reports it
                    log.info("No rehearsal write before the first save: %s", error)
            self._trace_copier(model, shadow, current)

        self.writer.submit(warm)

    def _trace_copier(self, model: keras.Model, shadow: keras.Model, ids: tuple[int, ...]):
        """In the writer thread: the traced copy for these variables (read by the next
        snapshot only after ``writer.wait()``: no race), called once, since its first call
        instantiates the function in TF's runtime (~70 ms) and would otherwise hold the
        next save. The values that call copies are replaced by the next save's copy."""
        if ids != _variable_ids(model):
            return  # variables created since: the next save copies eagerly
        try:
            copier = variable_copier(model, shadow)
            if copier is not None:
                copier()
            own_state = layer_protocol.own_state_pairs(model, shadow)
        except Exception as error:  # the saves copy variable by variable instead
            log.info("No traced snapshot copy: %s", error)
            return
        self._copier, self._own_state, self._copied = copier, own_state, ids

    def snapshot(self, model: keras.Model) -> keras.Model:
        """The shadow model (built once per source model), brought to ``model``'s state.

        Args:
            model: The model being trained.

        Returns:
            Its shadow, holding a copy of every variable of ``model`` as it is now.

        Raises:
            SaveError: The previous background write failed.
        """
        self.writer.wait()
        self._refresh(model, _variable_ids(model))()
        return self._shadow

    def _refresh(self, model: keras.Model, current: tuple[int, ...]) -> Callable[[], None]:
        """Take ``model``'s state for the shadow (built here if need be); returns what
        completes the shadow, to run before anything reads it (``take_snapshot``)."""
        if self._uncopied[0] is model:
            raise self._uncopied[1]
        if self._shadow is None or self._source is not model or not self._fits(model, current):
            try:
                self._shadow, self._source = clone_for_snapshot(model), model
            except SnapshotUnavailable as error:
                self._shadow = self._source = None
                self._uncopied = (model, error)
                raise
            self._forget_copier()
        if current != self._copied:
            self._forget_copier()  # variables created since: copy eagerly
        return take_snapshot(model, self._shadow, self._copier, self._own_state)

    def _forget_copier(self) -> None:
        """The traced copy and what was found with it no longer fit the models."""
        self._copier, self._own_state, self._copied = None, None, ()

    def _fits(self, model: keras.Model, current: tuple[int, ...]) -> bool:
        """The shadow still has a twin of every variable of ``model`` (shapes checked only
        when the variables changed since the copy was traced: a shadow built before the
        model created some, e.g. at the start of training, is built again)."""
        if current == self._copied:
            return True
        mine, theirs = all_variables(model), all_variables(self._shadow)
        return [tuple(v.shape) for v in mine] == [tuple(v.shape) for v in theirs]

    def wait(self) -> None:
        """Return once the write in flight is on disk.

        Raises:
            SaveError: That write failed; the previous checkpoints are intact.
        """
        self.writer.wait()
        super().wait()


def _variable_ids(model: keras.Model) -> tuple[int, ...]:
    """Which variables ``model`` has now (the traced copy is valid for exactly these)."""
    return tuple(id(v) for v in all_variables(model))


def _build_optimizer(model: keras.Model) -> None:
    """Create the optimizer's variables now, under the model's distribution strategy, which
    Keras does in the first training step (or before ``on_train_begin`` under a strategy):
    the shadow and the traced copy need every variable. A resumed run builds it before
    ``fit`` too, and continues bitwise like an uninterrupted one (the resume tests)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    strategy = getattr(model, "distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        kit.build_optimizer(model)
