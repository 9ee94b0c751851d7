"""Snapshots for background writes: a shadow model holding a copy of every variable.

Async saving takes every variable's value for a *shadow model* (same architecture, built
once) at the moment of the save, and a background thread writes the shadow through the
backend while training goes on. That works for every backend unchanged (they only ever see a
quiet model) and costs one memory copy per save.

What the training thread pays for an async save (issue 17) is the snapshot alone. When
no variable is distributed it is one read of every variable in one TensorFlow kernel: a
read shares the variable's buffer, and TensorFlow copies that buffer before it updates the
variable while the read value is held (copy on write), so the values of the step are kept
without a copy in the training thread. The writer thread then assigns them into the shadow
(one traced function) and drops them. Between the two, a variable the training updates is
held twice (its old value, its new one); that extra is bounded by ``BY_REFERENCE_BYTES``:
a model whose variables are larger is copied into the shadow before ``save`` returns, and
a save holds one extra copy of the variables at most. (A writer thread at a lower CPU
priority was tried and dropped: with other processes on the machine it starved, the first
write took 15 s instead of 2 and the next save waited for it.)
"""

from __future__ import annotations

import _thread
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from trainer._compat.tensorflow import call_flat, variables_reader
from trainer.checkpointing.shadow import all_variables
from trainer.errors import SaveError
from trainer.model_state import config_check, layer_protocol, trainable
from trainer.save_backends.savedmodel.bundle.variables_writer import total_bytes
from trainer.save_backends.savedmodel.features.keras_objects import tf_variable
from trainer.state import TrainingState
from trainer.storage import atomic

log = logging.getLogger(__name__)

# Variables up to this many bytes in all are snapshotted by reference (copy on write, see
# above); a larger model is copied in the training thread. 64 MiB: the default model's
# 69 variables are 0.2 MB, the benchmark's large one's (8.5M parameters with Adam's
# slots) 102 MB.
BY_REFERENCE_BYTES = 64 * 2**20


def copy_state(state: TrainingState) -> TrainingState:
    """A deep copy of ``state`` for a background write, made while the training thread
    waits: ``TrainingState.copy`` copies NumPy's RNG record (624 ints) at once, where
    ``copy.deepcopy`` copied it int by int (most of a 0.4 ms copy)."""
    return state.copy()


def refresh_snapshot(
    model: keras.Model,
    shadow: keras.Model,
    copier: VariableCopier | None = None,
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] | None = None,
) -> None:
    """Copy into ``shadow`` everything a backend would save from ``model``: every variable
    (weights, RNG seeds, optimizer, metrics), then the state that layers keep their own way
    (adapted preprocessing, lookup vocabularies: ``save_own_variables`` / assets), so that
    a write of the shadow holds what a synchronous save would.

    Args:
        model: The live model.
        shadow: Its copy from ``clone_for_snapshot``.
        copier: From ``variable_copier`` for these two models, if made already.
        pairs: ``layer_protocol.own_state_pairs`` of the two, if known.

    Raises:
        LayerStateError: A layer's own state methods (``save_own_variables``,
            ``load_own_variables``, assets) raised.
    """
    take_snapshot(model, shadow, copier, pairs)()


def take_snapshot(
    model: keras.Model,
    shadow: keras.Model,
    copier: VariableCopier | None = None,
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] | None = None,
) -> Callable[[], None]:
    """:func:`refresh_snapshot` in two halves: this call takes the state of ``model`` now;
    the function it returns completes ``shadow`` (run it, in the writer thread, before
    anything reads the shadow). With a ``copier`` holding its values by reference, the
    second half assigns the variables; otherwise everything is copied by this call."""
    try:
        trainable.match_trainable(model, shadow)  # a layer frozen since: saved as frozen
    except ValueError as error:
        raise SaveError(
            f"Async saving keeps a copy of model {model.name!r}, and its layers no longer "
            f"match the model's: {error}. Set checkpoint.async_save=false. Received: "
            f"{type(model).__name__}"
        ) from None
    config_check.copy_held_values(model, shadow)  # a dropout rate changed since, ...
    finish = _nothing
    if copier is not None:
        finish = copier.take()
    else:
        for source, target in zip(all_variables(model), all_variables(shadow), strict=True):
            target.assign(source)
    layer_protocol.copy_own_state(model, shadow, pairs)
    return finish


def _nothing() -> None:
    return None


class VariableCopier:
    """Copies every variable of ``model`` into its twin in ``shadow``: ``take()`` reads
    them all now and returns what assigns those values into the shadow (``put``, one
    traced function). Small models are held by reference until then (module docstring);
    larger ones are assigned by ``take`` itself. The function holds the shadow's
    variables, so a copier is built per (model, shadow) pair."""

    def __init__(self, model: keras.Model, shadow: keras.Model):
        # The variables themselves are held, so that their ids (which say whether this
        # copier still fits the model) cannot be given to new ones.
        self._variables = all_variables(model), all_variables(shadow)
        self._sources = [tf_variable(v) for v in self._variables[0]]
        targets = [tf_variable(v) for v in self._variables[1]]
        self.by_reference = total_bytes(self._sources) <= BY_REFERENCE_BYTES

        @tf.function(autograph=False)
        def put(values):
            for target, value in zip(targets, values, strict=True):
                target.assign(value)

        specs = [tf.TensorSpec(v.shape, v.dtype) for v in self._sources]
        # The concrete function itself, called with its flat inputs: through the
        # tf.function it would be looked up again on every save, and its own call checks
        # every value against its spec (values of these very variables: they match).
        self._put = put.get_concrete_function(specs)
        self.read = reader(self._sources)

    def put(self, values: list[tf.Tensor]) -> None:
        call_flat(self._put, values)

    def take(self) -> Callable[[], None]:
        values = self.read()
        if not self.by_reference:
            self.put(values)
            return _nothing

        def put_and_release():
            self.put(values)
            values.clear()  # the old buffers a training step replaced since are freed

        return put_and_release

    def __call__(self) -> None:
        self.put(self.read())


def reader(variables: list[tf.Variable]) -> Callable[[], list[tf.Tensor]]:
    """A function returning the values of ``variables`` now, in one kernel where TensorFlow
    has it (``variables_reader``), else one read each."""
    return variables_reader(variables) or (lambda: [v.read_value() for v in variables])


class ValueReader:
    """Reads a list of Keras variables as NumPy arrays at once, e.g. the metrics'
    accumulators at every save (one eager read each cost the training thread 0.23 ms for
    the default model's four). The reader is kept while the same variables are asked for."""

    def __init__(self):
        self._variables: list = []  # held: their ids cannot go to new variables
        self._read: Callable[[], list[tf.Tensor]] | None = None

    def __call__(self, variables: list) -> list[np.ndarray]:
        if len(variables) != len(self._variables) or any(
            a is not b for a, b in zip(variables, self._variables, strict=False)
        ):
            self._variables = list(variables)
            storage = [tf_variable(v) for v in self._variables]
            if any(isinstance(v, tf.distribute.DistributedValues) for v in storage):
                self._read = None  # read through the strategy, as Keras does
            else:
                self._read = reader(storage)
        if self._read is None:
            return [keras.ops.convert_to_numpy(v) for v in self._variables]
        return [value.numpy() for value in self._read()]


def variable_copier(model: keras.Model, shadow: keras.Model) -> VariableCopier | None:
    """The copier of ``model``'s variables into ``shadow``'s, or None where the eager loop
    must do it: a distributed (mirrored) variable is read and assigned through its
    strategy, which the eager path handles as Keras does."""
    pairs = list(zip(all_variables(model), all_variables(shadow), strict=True))
    for source, target in pairs:
        for variable in (source, target):
            if isinstance(getattr(variable, "value", None), tf.distribute.DistributedValues):
                return None
    try:
        return VariableCopier(model, shadow)
    except (TypeError, ValueError, tf.errors.OpError) as error:  # an unusual variable type
        log.debug("Snapshot copy not traced (%s); assigning variable by variable", error)
        return None


class AsyncWriter:
    """One background write at a time; its failure is raised at the next call, never lost.

    The writes run in one long-lived thread per writer, started by the first ``submit``:
    a thread started per save paid TensorFlow's and Keras' per-thread setup in every
    write (the writer's CPU per save in default runs whose saves alternated between the
    two, medians: 4.42 and 4.12 ms in a new thread, 4.18 and 3.92 ms in the kept one;
    issue 17). It is started with
    ``_thread.start_new_thread`` rather than ``threading.Thread.start``, which waits
    until the new thread has run far enough to signal that it started (that needs the
    GIL: about 10 ms of the training thread on a busy machine). It ends when the writer
    is garbage collected, and a writer used again in a forked child starts its own. Its
    writes flush a finished directory with one ``syncfs``
    (``atomic.flushing_whole_filesystem``)."""

    def __init__(self):
        self._done: threading.Event | None = None
        self._error: list[BaseException] = []  # filled by the thread, emptied by ``wait``
        self._jobs: queue.SimpleQueue | None = None
        self._pid = 0  # the process whose thread serves ``_jobs``

    def submit(self, job: Callable[[], None]) -> None:
        """Hand a write to the writer thread, after the previous one has finished.

        Args:
            job: The write, called with no arguments in the writer thread.

        Raises:
            BaseException: Whatever the previous write raised (a ``SaveError`` for a failed
                checkpoint write), raised here rather than lost.
        """
        self.wait()
        done = self._done = threading.Event()
        if self._jobs is None or self._pid != os.getpid():
            self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
            _thread.start_new_thread(_serve, (self._jobs,))
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with the writer
        self._jobs.put((job, done, self._error))

    @property
    def busy(self) -> bool:
        """A write is still running (the next ``submit`` would wait for it)."""
        return self._done is not None and not self._done.is_set()

    def wait(self) -> None:
        """Return once the write in flight has finished.

        Raises:
            BaseException: Whatever that write raised (a ``SaveError`` for a failed checkpoint
                write).
        """
        if self._done is not None:
            self._done.wait()
            self._done = None
        if self._error:
            raise self._error.pop()


def _serve(jobs: queue.SimpleQueue) -> None:
    """The writer thread: runs each job handed to it until it gets None. Holds no reference
    to its ``AsyncWriter``, so that the writer can be collected (which sends the None)."""
    while (item := jobs.get()) is not None:
        job, done, errors = item
        try:
            with atomic.flushing_whole_filesystem():  # waits only in the background
                job()
        except BaseException as error:  # re-raised in the training thread
            errors.append(error)
        finally:
            del job, item  # nothing of a finished write is held while waiting for the next
            done.set()
