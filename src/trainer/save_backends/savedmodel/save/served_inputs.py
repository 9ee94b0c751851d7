"""The inputs a model is served with, and what each layer receives from them.

Keras types a subclassed model's inputs with its float compute dtype (it records no dtype
for the calls of a subclassed model), and a model on integer ids is served and revived with
those ids only if the save finds them: in the casts of the float trace, or by trying ids
where the model cannot run on floats at all. Each attempt is a throwaway trace of the
serving function that records what every layer's ``call`` receives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import call_records
from trainer.errors import ModelNotReadyError
from trainer.save_backends.savedmodel.save import endpoints, input_signature, tracing


def record_served_specs(
    model: keras.Model, recorder: tracing.CallRecorder, args: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Record every layer's call specs for the inputs the model is served with, and return
    those inputs. A subclassed model is typed by Keras as taking floats: if it takes
    integer ids instead (``input_signature.integer_inputs`` finds them in the float trace;
    a model that cannot run on floats at all is tried on int32 ids), it is served with
    them, and traced for the other integer width too where it runs on it, so its revival
    takes int32 and int64 ids alike (and floats, where they traced)."""
    empty = recorder.snapshot()
    try:
        concrete = record_call_specs(model, recorder, args)
    except ModelNotReadyError as error:
        recorder.restore(empty)  # the layers the failed trace reached recorded floats
        declared = input_signature.declared_batch(model, args)
        if declared is not None and first_tracing(model, recorder, [declared]) is not None:
            return declared
        integer = first_tracing(model, recorder, input_signature.id_candidates(model, args))
        if integer is None:
            raise error
    else:
        integer = input_signature.integer_inputs(model, args, concrete)
        if integer is not None:
            record_call_specs(model, recorder, integer)
    if integer is None:
        if _converts_its_inputs(model):
            for variant in input_signature.integer_variants(model, args):
                first_tracing(model, recorder, [variant])
        _trace_composites(model, recorder, [args])
        return args
    other = input_signature.other_integer_width(integer)
    if other is not None and first_tracing(model, recorder, [other]) is not None:
        _trace_composites(model, recorder, [integer, other])
    else:
        _trace_composites(model, recorder, [integer])
    return integer


def _trace_composites(model: keras.Model, recorder: tracing.CallRecorder, served: list) -> None:
    """Trace the sparse and ragged forms of each served input structure where the model
    runs on them (``input_signature.composite_variants``): a subclassed model called on
    sparse or ragged tensors is then revived taking them, as the original does."""
    for structure in served:
        for variant in input_signature.composite_variants(model, structure):
            before = recorder.snapshot()
            if first_tracing(model, recorder, [variant]) is not None and not _trains_on(
                model, variant
            ):
                recorder.restore(before)


def _trains_on(model: keras.Model, structure: Any) -> bool:
    """Whether a throwaway training-mode trace of the model runs on ``structure``. A
    random image augmentation passes a sparse input through unchanged in inference and
    fails on it in training: every layer's training function is traced from what the
    inference trace recorded, so a kind the model only infers on would fail the save."""
    try:
        endpoints.make_serve(model, structure, training=True).get_concrete_function()
    except Exception:  # the model's own code, in a tf.function: user code
        return False
    return True


def first_tracing(
    model: keras.Model, recorder: tracing.CallRecorder, candidates: list[Any]
) -> Any | None:
    """The first of ``candidates`` (input structures) the model traces on, its specs
    recorded; None if it traces on none (what failed traces recorded is dropped)."""
    for candidate in candidates:
        before = recorder.snapshot()
        try:
            record_call_specs(model, recorder, candidate)
        except ModelNotReadyError:
            recorder.restore(before)
            continue
        return candidate
    return None


def record_call_specs(
    model: keras.Model, recorder: tracing.CallRecorder, args: tuple[Any, ...]
) -> Any:
    """A throwaway trace of the serving function that only records what each layer
    receives: the specs every layer's own functions are then traced with. Returns the
    concrete function of that trace."""
    recording = endpoints.make_serve(model, args)
    try:
        with recorder:
            concrete = recording.get_concrete_function()
    except ModelNotReadyError:
        raise
    except Exception as err:  # the model's own call, in a tf.function: user code
        raise ModelNotReadyError(
            f"Model {model.name!r} could not be traced for serving: {type(err).__name__}: "
            f"{err}. Make sure it can be called in a tf.function on inputs of the shapes it "
            f"was built with. If it takes integer ids, declare them (self.input_spec = "
            f"keras.InputSpec(dtype='int32')). If it takes ragged or sparse tensors, build "
            f"it as a Functional "
            f"model on keras.Input(ragged=True) or keras.Input(sparse=True): a subclassed "
            f"model records only the shapes of its inputs, not their kind. "
            f"Received {type(model).__name__}"
        ) from err
    return concrete


@contextlib.contextmanager
def leaving_no_trace_state() -> Iterator[None]:
    """Undo what a failed trace leaves in TensorFlow's process-wide state. ``tf.map_fn`` in
    a traced function sets a caching device on the variable scope, which a tf.function
    shares with the eager program, and unsets it only when its ``fn`` succeeds: a throwaway
    trace failing inside it (a model's per-row ``map_fn`` tried on sparse rows) left every
    later ``tf.distribute`` scope of the process unusable ("Caching devices is not yet
    supported when eager execution is enabled"), half-entered, and with it every later
    ``fit``. The save's tries must cost the user's process nothing: ``trace_cache`` runs
    the whole tracing of a save inside this. Nor do they count as calls of the model
    (``call_records``): a later save would try every form tried here again."""
    scope = tf.compat.v1.get_variable_scope()  # the same object the traces see
    caching_device = scope.caching_device
    try:
        with call_records.paused():
            yield
    finally:
        if scope.caching_device is not caching_device:
            # Its setter refuses to run eagerly; the scope is the default graph's.
            with tf.compat.v1.get_default_graph().as_default():
                scope.set_caching_device(caching_device)


def _converts_its_inputs(model: keras.Model) -> bool:
    """Whether the model holds one of Keras' layers that convert whatever dtype they get
    (``tracing.converts_before_call``: image augmentations, ``Rescaling``): such a model
    is as likely called on integer images as on floats, and Keras records no dtype for a
    subclassed model's calls, so its revival is traced on both (see ``integer_variants``)."""
    return any(tracing.converts_before_call(x) for x in tracing.all_layers(model))
