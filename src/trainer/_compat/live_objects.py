"""Attributes trainer puts on live Keras objects: its declared markers and method patches.

Why a door of its own: a Keras layer's ``__setattr__`` tracks what it is given (a list
becomes a tracked list, a layer a sublayer, a variable a weight; on the TensorFlow
backend, ``KerasAutoTrackable.__setattr__`` also makes a trackable value, such as a
loaded SavedModel, a checkpoint dependency of the layer), and trainer's own
bookkeeping on a layer (a loaded SavedModel kept alive, the traced functions a stand-in
calls) must not become layer state: it would be counted in the layer's weights or
sublayers, walked by Keras's saving, and fingerprinted as structure. Everything trainer
stores on a Keras object therefore goes through here, under a name declared below, set
with ``object.__setattr__`` (Keras's tracking bypassed), and every method trainer
replaces on a live object goes through ``patch_method`` (except the workarounds in
``keras_bugs``, which document what they replace themselves). ``tests/_compat/test_live_objects.py``
fails on any ``object.__setattr__`` or marker name spelled out elsewhere in trainer, and
on a declared marker nothing uses.

The attribute names are the ones trainer has always set (``_trainer_...``): tests and
user code that inspect a revived layer read them. Checked: Keras 3.15.1
(``Layer.__setattr__`` tracks through ``Layer._tracker``, then
``KerasAutoTrackable.__setattr__``), TensorFlow 2.21.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# --------------------------------------------------------------- markers of stand-ins
# Each marker is the attribute's name, with what it records. They live on the object
# because the object is all later code is handed (a model, one of its layers, in a
# callback, a save, a copy): nothing else follows it there.

# Where a layer standing in for a missing class was revived from (a phrase, a class
# attribute of the stand-in classes); config-only backends and async copies refuse it.
REVIVED_FROM = "_trainer_revived_from"
# The saved identity of the class a stand-in replaces (class, module, registered name,
# Keras config): a re-save writes it again, so the layer stays revivable with its class.
ORIGINAL_IDENTITY = "_trainer_original"
# A stand-in's traced inference ``call`` (the loaded function it runs; re-saved from it).
TRACED_INFERENCE_CALL = "_trainer_call_infer"
# A stand-in's traced training ``call``, or None when the save traced none.
TRACED_TRAINING_CALL = "_trainer_call_train"
# A stand-in's traced ``call`` with ``training`` left unresolved (no argument, no outer
# call: each sublayer takes its own default), or None when that cannot differ from False.
TRACED_DEFAULT_CALL = "_trainer_call_default"
# Whether the save traced the layer in training mode (serving exports trace inference only).
TRAINING_WAS_TRACED = "_trainer_training_traced"
# Whether the layer's gradient was Python code no trace carries: training must be refused.
PYTHON_GRADIENT = "_trainer_python_gradient"
# The original ``call``'s signature without ``self``: binds a call as the original did.
CALL_SIGNATURE = "_trainer_signature"
# Names of ``call`` parameters whose saved defaults were not plain values (not replayed).
OPAQUE_DEFAULTS = "_trainer_opaque_defaults"
# A stand-in's traced ``compute_mask``, or None (Keras's default then passes masks on).
TRACED_COMPUTE_MASK = "_trainer_compute_mask"
# Whether the inference trace takes the Keras masks of its inputs as one more argument.
TAKES_INPUT_MASKS = "_trainer_takes_masks"
# The first positional input structure of the inference trace. Nothing in trainer reads it
# since 6d32f78 (endpoints read the trace itself); still set, as before, on every stand-in.
INPUT_STRUCTURE = "_trainer_input_structure"
# The trainable flags of the stand-in and its sublayers when traced: training with other
# flags than the training trace was made with is refused.
FROZEN_FLAGS = "_trainer_frozen_flags"

# ------------------------------------------------------------- markers of loaded models
# The loaded SavedModel (or what keeps its functions alive): the stand-ins' traced
# functions belong to it and die with it, so it must live exactly as long as the model.
LOADED_SAVEDMODEL = "_trainer_loaded"
# The input names of the serving signature a model was loaded from: a re-save or export of
# a revived model (whose traced inputs are ``args_<i>``) keeps the same input keys.
SERVING_INPUT_NAMES = "_trainer_input_names"
# The input dtypes of that signature: a re-save serves the trace of the same dtypes.
SERVING_INPUT_DTYPES = "_trainer_input_dtypes"

# ------------------------------------------------ markers of legacy (tf.keras) stand-ins
# True on a layer revived from a legacy SavedModel's traces: it shares the loaded
# variables themselves, so the importer assigns it no values.
LEGACY_REVIVED = "_trainer_legacy_revived"
# The legacy layer's traced ``call_and_return_conditional_losses`` the stand-in runs.
LEGACY_TRACED_CALL = "_trainer_function"
# The arguments after the inputs the legacy trace fixed (a training flag, a None mask).
LEGACY_EXTRA_ARGUMENTS = "_trainer_extra"
# The legacy layer's config translated to Keras 3: what ``get_config`` returns.
LEGACY_CONFIG = "_trainer_config"
# The argument-free traced weight regularizers re-added to the loss on every call.
LEGACY_REGULARIZERS = "_trainer_regularizers"

MARKERS = frozenset(
    value
    for name, value in dict(globals()).items()
    if name.isupper() and isinstance(value, str) and value.startswith("_trainer_")
)


# -------------------------------------------------------------------------- helpers
def set_untracked(target: Any, name: str, value: Any) -> None:
    """``target.name = value`` without Keras's tracking ``__setattr__`` (see the module's
    docstring): the value stays a plain attribute, invisible to the layer's weights,
    sublayers and saving. Used for declared markers and for the few attributes trainer
    swaps for a moment (a pruned kernel during a call) or sets as Keras itself keeps them
    untracked (a stateful RNN's ``states``). On a class, a plain class attribute."""
    if isinstance(target, type):
        type.__setattr__(target, name, value)
    else:
        object.__setattr__(target, name, value)


def _declared(marker: str) -> str:
    if marker not in MARKERS:
        raise ValueError(
            f"{marker!r} is not a marker declared in trainer._compat.live_objects; declare "
            f"it there (one name, one comment) before trainer sets it on Keras objects."
        )
    return marker


def set_marker(target: Any, marker: str, value: Any) -> None:
    """Record ``value`` on ``target`` (a Keras object or a class) under a declared marker,
    untracked by Keras (``set_untracked``)."""
    set_untracked(target, _declared(marker), value)


def get_marker(target: Any, marker: str, default: Any = None) -> Any:
    """The value of a declared marker on ``target`` (its class's, for a class attribute),
    or ``default`` when the object carries none (a layer trainer did not revive)."""
    return getattr(target, _declared(marker), default)


def delete_marker(target: Any, marker: str) -> None:
    """Remove a declared marker from ``target`` itself; nothing happens if it has none."""
    if _declared(marker) in vars(target):
        if isinstance(target, type):
            type.__delattr__(target, marker)
        else:
            object.__delattr__(target, marker)


def patch_method(target: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Replace method ``name`` of ``target`` (an instance or a class) by ``replacement``;
    returns the function that puts back exactly what was there before. Call the restorers
    in reverse order when one method is patched twice.

    On an instance, the replacement is an attribute of that instance alone (the class and
    its other instances are untouched), set untracked (``set_untracked``), and called
    without the instance. A special method (``__call__``) is looked up on the type, never
    on the instance: the instance then gets a subclass of its class made for it alone,
    named like its class, holding ``replacement``, which receives the instance first as
    any method defined in a class does; restoring gives the instance its class back.
    """
    if not isinstance(target, type) and _is_special(name):
        original_class = type(target)
        body = {name: replacement, "__module__": original_class.__module__}
        one_off = type(original_class.__name__, (original_class,), body)
        object.__setattr__(target, "__class__", one_off)
        return lambda: object.__setattr__(target, "__class__", original_class)
    own = vars(target)
    had_own, previous = name in own, own.get(name)
    set_untracked(target, name, replacement)

    def restore() -> None:
        if had_own:
            set_untracked(target, name, previous)
        elif name in vars(target):
            if isinstance(target, type):
                type.__delattr__(target, name)
            else:
                object.__delattr__(target, name)

    return restore


def _is_special(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")
