"""Snapshots for background writes: a shadow model holding a copy of every variable.

Async saving copies every variable synchronously into a *shadow model* (same architecture,
built once) and lets a background thread write the shadow through the backend while training
goes on. That works for every backend unchanged (they only ever see a quiet model) and costs
one memory copy per save.

What the training thread pays for an async save (issue 17) is the copy alone: it runs as
one traced TensorFlow function (one call, not one eager op per variable) when no variable
is distributed. (A writer thread at a lower CPU priority was tried and dropped: with other
processes on the machine it starved, the first write took 15 s instead of 2 and the next
save waited for it.)
"""

from __future__ import annotations

import _thread
import logging
import threading
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from trainer import atomic
from trainer._compat.keras import get_input_signature
from trainer.errors import SaveError
from trainer.save_backends import layerstate, modelstate, trainable
from trainer.state import TrainingState

log = logging.getLogger(__name__)


def all_variables(model: keras.Model) -> list:
    """Every variable whose value a checkpoint holds: weights, RNG seeds, optimizer, metrics."""
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = list(optimizer.variables) if optimizer is not None else []
    return [*model.variables, *optimizer_variables]


def copy_state(state: TrainingState) -> TrainingState:
    """A deep copy of ``state`` for a background write, made while the training thread
    waits: ``TrainingState.copy`` copies NumPy's RNG record (624 ints) at once, where
    ``copy.deepcopy`` copied it int by int (most of a 0.4 ms copy)."""
    return state.copy()


def refresh_snapshot(
    model: keras.Model,
    shadow: keras.Model,
    copier: Callable | None = None,
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] | None = None,
):
    """Copy into ``shadow`` everything a backend would save from ``model``: every variable
    (weights, RNG seeds, optimizer, metrics), then the state that layers keep their own way
    (adapted preprocessing, lookup vocabularies: ``save_own_variables`` / assets), so that
    the background write of the shadow holds what a synchronous save would. ``copier``:
    from ``variable_copier`` for these two models (one traced call instead of one eager
    assign per variable); ``pairs``: ``layerstate.own_state_pairs`` of the two, if known."""
    try:
        trainable.match_trainable(model, shadow)  # a layer frozen since: saved as frozen
    except ValueError as error:
        raise SaveError(
            f"Async saving keeps a copy of model {model.name!r}, and its layers no longer "
            f"match the model's: {error}. Set checkpoint.async_save=false. Received: "
            f"{type(model).__name__}"
        ) from None
    if copier is not None:
        copier()
    else:
        for source, target in zip(all_variables(model), all_variables(shadow), strict=True):
            target.assign(source)
    layerstate.copy_own_state(model, shadow, pairs)


def variable_copier(model: keras.Model, shadow: keras.Model) -> Callable[[], None] | None:
    """A traced function assigning every variable of ``model`` to its twin in ``shadow``
    in one call, or None where the eager loop must do it: a distributed (mirrored) variable
    is read and assigned through its strategy, which the eager path handles as Keras does.
    The function holds the variables, so it is built per (model, shadow) pair."""
    pairs = list(zip(all_variables(model), all_variables(shadow), strict=True))
    for source, target in pairs:
        for variable in (source, target):
            if isinstance(getattr(variable, "value", None), tf.distribute.DistributedValues):
                return None

    @tf.function(autograph=False)
    def copy_all():
        for source, target in pairs:
            target.assign(source.value)

    try:
        concrete = copy_all.get_concrete_function()
    except (TypeError, ValueError, tf.errors.OpError) as error:  # an unusual variable type
        log.debug("Snapshot copy not traced (%s); assigning variable by variable", error)
        return None
    # The concrete function itself: calling the tf.function would look it up again on
    # every save, hashing every captured variable (a sixth of the training thread's wait).
    return concrete


def clone_for_snapshot(model: keras.Model) -> keras.Model:
    """A second model of the same architecture and compile state, with its own variables."""
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    modelstate.mark_private_copy(clone)  # only trainer changes it, and only so
    _call_once_like(model, clone)
    modelstate.build_optimizer(model)
    compile_config = modelstate.compile_config(model)
    if compile_config and any(
        k in compile_config for k in (trainable.BUILT_FOR, trainable.NO_DECAY)
    ):
        # Keras compiled the clone from its config and built the optimizer for its trainable
        # variables, deciding weight decay by the config alone: compile it again the way a
        # load does, which builds a fresh optimizer like the model's. The live model's own
        # config, so no safe mode.
        where = f"the async copy of model {model.name!r}"
        modelstate.compile_model(
            clone, compile_config, custom_objects={}, safe_mode=False, where=where
        )
    mine, theirs = all_variables(model), all_variables(clone)
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:
        raise SaveError(
            f"Async saving needs a copy of model {model.name!r} rebuilt from its config, but "
            f"the copy's variables differ from the original's. Set checkpoint.async_save=false. "
            f"Received {len(mine)} variables vs {len(theirs)} in the copy"
        )
    return clone


def _call_once_like(model: keras.Model, clone: keras.Model) -> None:
    """A subclassed model knows its input signature (which the SavedModel backend traces
    with) only once called: call the fresh clone once on zeros shaped and typed like the
    live model's inputs. Graph models (Functional, Sequential) know theirs already."""
    try:
        get_input_signature(clone)
        return
    except ValueError:
        pass
    try:
        signature = get_input_signature(model)
    except ValueError:
        return  # the live model was never called either: the backend says so when saving

    def zeros(spec):
        return np.zeros([1 if d is None else d for d in spec.shape], dtype=spec.dtype)

    clone(*keras.tree.map_structure(zeros, signature))


class AsyncWriter:
    """One background write at a time; its failure is raised at the next call, never lost.

    Started with ``_thread.start_new_thread`` rather than ``threading.Thread.start``: the
    latter waits until the new thread has run far enough to signal that it started, which
    needs the GIL, and costs the training thread about 10 ms per save on a busy machine
    (issue 17: as much as the snapshot copy itself). Its writes flush a finished directory
    with one ``syncfs`` (``atomic.flushing_whole_filesystem``)."""

    def __init__(self):
        self._done: threading.Event | None = None
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        done = self._done = threading.Event()

        def run():
            try:
                with atomic.flushing_whole_filesystem():  # waits only in the background
                    job()
            except BaseException as error:  # re-raised in the training thread
                self._error = error
            finally:
                done.set()

        _thread.start_new_thread(run, ())

    @property
    def busy(self) -> bool:
        """A write is still running (the next ``submit`` would wait for it)."""
        return self._done is not None and not self._done.is_set()

    def wait(self) -> None:
        if self._done is not None:
            self._done.wait()
            self._done = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
