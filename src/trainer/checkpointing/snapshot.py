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
import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer import atomic
from trainer._compat.keras import get_input_signature, sublayers
from trainer._compat.tensorflow import call_flat, variables_reader
from trainer.errors import SaveError
from trainer.save_backends import (
    config_state,
    layerstate,
    modelstate,
    policies,
    readiness,
    trainable,
)
from trainer.save_backends.savedmodel.tracing import tf_variable
from trainer.state import TrainingState

log = logging.getLogger(__name__)

# Variables up to this many bytes in all are snapshotted by reference (copy on write, see
# above); a larger model is copied in the training thread. 64 MiB: the default model's
# 69 variables are 0.2 MB, the benchmark's large one's (8.5M parameters with Adam's
# slots) 102 MB.
BY_REFERENCE_BYTES = 64 * 2**20


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
    copier: VariableCopier | None = None,
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] | None = None,
) -> None:
    """Copy into ``shadow`` everything a backend would save from ``model``: every variable
    (weights, RNG seeds, optimizer, metrics), then the state that layers keep their own way
    (adapted preprocessing, lookup vocabularies: ``save_own_variables`` / assets), so that
    a write of the shadow holds what a synchronous save would. ``copier``: from
    ``variable_copier`` for these two models; ``pairs``: ``layerstate.own_state_pairs`` of
    the two, if known."""
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
    config_state.copy_held_values(model, shadow)  # a dropout rate changed since, ...
    finish = _nothing
    if copier is not None:
        finish = copier.take()
    else:
        for source, target in zip(all_variables(model), all_variables(shadow), strict=True):
            target.assign(source)
    layerstate.copy_own_state(model, shadow, pairs)
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
        nbytes = sum(v.shape.num_elements() * v.dtype.size for v in self._sources)
        self.by_reference = nbytes <= BY_REFERENCE_BYTES

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


class SnapshotUnavailable(SaveError):
    """No shadow of the model can be built from its config: its saves are written
    synchronously instead (``AsyncBackend``), with a warning saying why."""


def clone_for_snapshot(model: keras.Model) -> keras.Model:
    """A second model of the same architecture and compile state, with its own variables,
    built under the model's own dtype policy (``policies``: a mixed-precision model keeps
    its ``LossScaleOptimizer`` whatever the global policy is now).

    The config is the live model's, serialized a moment ago in this process: it is rebuilt
    outside safe mode (a ``Lambda``'s code is the model's own), unless a layer was revived
    from traced functions (its config is the one its checkpoint stored), and with every
    class of the model at hand, registered or not. A model that still
    cannot be copied raises ``SnapshotUnavailable`` (its saves are then synchronous)."""
    try:
        with policies.global_policy(getattr(model, "dtype_policy", None)):
            clone = _rebuilt_and_compiled(model)
    except Exception as error:  # whatever the model's own code raises
        raise _copy_failed(model, error) from error
    mine, theirs = all_variables(model), all_variables(clone)
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:
        raise SnapshotUnavailable(
            f"Async saving keeps a copy of model {model.name!r} rebuilt from its config and "
            f"copies the variables into it by position, but the copy's variables differ from "
            f"the original's ({_difference(mine, theirs)}), so its checkpoints are written "
            f"synchronously. Set checkpoint.policy.async_save=false to silence this. Received: "
            f"{len(mine)} variables in the model, {len(theirs)} in the copy"
        )
    return clone


def _described(variable: Any) -> tuple[str, list, str]:
    path = getattr(variable, "path", None) or getattr(variable, "name", "?")
    return str(path), list(variable.shape), str(variable.dtype)


def _difference(mine: list, theirs: list) -> str:
    """What differs: the number of variables, or the same variables created in another
    order (a model quantized in place makes its quantization variables after its weights;
    one rebuilt quantized, before them), or other variables; with the first position
    where they differ."""
    if len(mine) != len(theirs):
        return f"{len(mine)} variables in the model, {len(theirs)} in the copy"
    pairs = enumerate(zip(mine, theirs, strict=True))
    first = next(i for i, (a, b) in pairs if a.shape != b.shape)
    if sorted(map(str, map(_described, mine))) == sorted(map(str, map(_described, theirs))):
        what = f"the same {len(mine)} variables, created in another order"
    else:
        what = f"{len(mine)} variables each, not the same names, shapes or dtypes"
    return (
        f"{what}: variable {first} is {_described(mine[first])} in the model, "
        f"{_described(theirs[first])} in the copy"
    )


def _copy_failed(model: keras.Model, error: Exception) -> SnapshotUnavailable:
    """Why no copy could be made. A layer revived from traced functions (its class was
    missing at load) is rebuilt from the config its checkpoint stored, which names that
    class: the class is what is missing, not a registration of a class the user has."""
    received = f"Received {type(error).__name__}: {str(error)[:300]}"
    revived = readiness.revived_layers(model)
    if revived:
        first = revived[0]
        original = getattr(first, "_trainer_original", None) or {}
        cls = original.get("registered_name") or original.get("class_name") or "its class"
        if type(first).__name__ == "LegacyLambda" or original.get("carries_code"):
            why = "its stored Python code was not run (a Lambda), and the copy runs none either"
            remedy = "load the checkpoint with safe_mode=False if you trust it"
        else:
            why = f"its class {cls!r} was not available when the checkpoint was loaded"
            remedy = (
                f"load the checkpoint where the class is importable (or pass "
                f"custom_objects={{{original.get('class_name', cls)!r}: cls}})"
            )
        return SnapshotUnavailable(
            f"Async saving keeps a copy of model {model.name!r} rebuilt from its config, but "
            f"layer {first.name!r} was revived from the traced functions of "
            f"{first._trainer_revived_from} ({why}): it cannot be rebuilt from its config. Its "
            f"checkpoints are written synchronously (training waits for each write) and "
            f"still hold the traced functions. To save asynchronously, {remedy}; or set "
            f"checkpoint.policy.async_save=false to silence this. {received}"
        )
    return SnapshotUnavailable(
        f"Async saving keeps a copy of model {model.name!r} rebuilt from its config, and "
        f"that copy could not be made, so its checkpoints are written synchronously "
        f"(training waits for each write). Make the model's classes rebuildable from "
        f"get_config() (keras.saving.register_keras_serializable), or set "
        f"checkpoint.policy.async_save=false to silence this. {received}"
    )


def _rebuilt_and_compiled(model: keras.Model) -> keras.Model:
    # A layer revived from traced functions returns the config its checkpoint stored: data
    # from a file, which may hold a Lambda's bytecode (the load ran none of it). Such a
    # model is copied in safe mode; one built in this process, outside it.
    safe_mode = bool(readiness.revived_layers(model))
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(model),
        custom_objects=_classes_of(model),
        safe_mode=safe_mode,
    )
    modelstate.mark_private_copy(clone)  # only trainer changes it, and only so
    _call_once_like(model, clone)
    modelstate.build_optimizer(model)
    compile_config = modelstate.compile_config(model)
    if compile_config and any(k in compile_config for k in modelstate.RECORDED_KEYS):
        # Keras compiled the clone from its config and built the optimizer for its
        # trainable variables, deciding weight decay and loss scaling by the config
        # alone: compile it again the way a load does, which builds a fresh optimizer
        # like the model's.
        where = f"the async copy of model {model.name!r}"
        modelstate.compile_model(
            clone, compile_config, custom_objects={}, safe_mode=safe_mode, where=where
        )
    return clone


def _classes_of(model: keras.Model) -> dict[str, type]:
    """Every layer class in ``model`` (the model's own included) under the name its
    config records for it (``registered_name``: the class name if it is not registered),
    so that unregistered classes are found. A name two classes share is left out: Keras
    then looks it up as usual (and, failing, the saves are synchronous)."""
    classes: dict[str, type] = {}
    shared: set[str] = set()
    for layer in sublayers(model, include_self=True):
        cls = type(layer)
        name = keras.saving.get_registered_name(cls)
        if classes.setdefault(name, cls) is not cls:
            shared.add(name)
    return {name: cls for name, cls in classes.items() if name not in shared}


def _call_once_like(model: keras.Model, clone: keras.Model) -> None:
    """A subclassed model knows its input signature (which the SavedModel backend traces
    with) only once called: call the fresh clone once, symbolically (no op runs), on
    inputs shaped and typed like the live model's. Keras types them with the model's float
    dtype, whatever it takes: a model taking strings cannot run on float zeros (the call
    they were given failed, and with it every async save). Graph models (Functional,
    Sequential) know theirs already. A model that cannot be called so stays uncalled: the
    backend then takes the shapes Keras recorded when it was built."""
    try:
        get_input_signature(clone)
        return
    except ValueError:
        pass
    try:
        signature = get_input_signature(model)
    except ValueError:
        return  # the live model was never called either: the backend says so when saving
    with contextlib.suppress(Exception):  # the model's own call: anything
        clone(*keras.tree.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype), signature))


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
