"""Keras internals that trainer needs and Keras 3 exposes no public API for.

Every helper names the private attribute or module it uses, why no public API does the
job, and the version it was checked against: Keras 3.15.1 with TensorFlow 2.21.0, the
TensorFlow backend. ``tests/_compat/test_canaries.py`` checks each helper against the behaviour it
relies on. Workarounds of Keras bugs live in ``keras_bugs``.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf


# ----------------------------------------------------------------------------- layers
def sublayers(
    layer: keras.layers.Layer, *, include_self: bool = False, recursive: bool = True
) -> list[keras.layers.Layer]:
    """The sublayers of ``layer`` (and ``layer`` itself first if ``include_self``), each
    once, in Keras' own order; only the direct ones unless ``recursive``.

    Uses ``Layer._flatten_layers``. Public alternatives do not cover it: ``Model.layers``
    exists on models only (not on plain layers holding sublayers) and lists direct children
    only, without the nested ones. Checked: Keras 3.15.1.
    """
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def keras_mask(value: Any) -> Any:
    """The Keras mask attached to a tensor (``None`` if none).

    ``keras.src.backend.get_keras_mask``: Keras attaches masks to tensors as a private
    attribute and reads them back with this helper; no public API exposes it. Needed to
    know the mask a layer's ``compute_mask`` receives while its call is recorded for
    tracing. Checked: Keras 3.15.1.
    """
    from keras.src import backend

    return backend.get_keras_mask(value)


def set_keras_mask(value: Any, mask: Any) -> None:
    """Attach ``mask`` to ``value`` as its Keras mask, as a layer's output gets it.

    ``keras.src.backend.set_keras_mask``, the counterpart of ``keras_mask``: no public API.
    A layer's traced call attaches the masks its inputs carried when it was recorded, since
    layers read them from their inputs (``MultiHeadAttention``). Checked: Keras 3.15.1.
    """
    from keras.src import backend

    backend.set_keras_mask(value, mask)


def outer_training() -> bool | None:
    """The ``training`` value of the Keras layer call in progress (``None`` outside one).

    Keras resolves ``training`` for every layer call, whether or not that layer's ``call``
    declares it, and passes it down to sublayers through the active ``CallContext``
    (``keras.src.backend.common.global_state`` attribute ``current_call_ctx``). A traced
    function standing in for such a layer's ``call`` receives no ``training`` argument, so
    it reads the value here to pick its training or inference trace. No public API exposes
    the call context. Checked: Keras 3.15.1.
    """
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def tracked_sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The direct sublayers exactly as ``layer`` tracks them: in tracking order, which is
    the order of its weights, and with repeats (``Sequential([d, d])`` lists ``d`` twice),
    unlike ``sublayers(layer, recursive=False)``.

    Uses ``Layer._layers``, the tracker's list; no public API returns it (``Model.layers``
    hides repeats and exists on models only). Checked: Keras 3.15.1.
    """
    return list(layer._layers)


def replace_tracked_sublayer(
    owner: keras.layers.Layer, old: keras.layers.Layer, new: keras.layers.Layer
) -> None:
    """Make ``owner`` track ``new`` instead of ``old``, at ``old``'s position in its list of
    sublayers (so the order of the weights, which positional loading relies on, stays).

    Uses ``Layer._tracker`` (``replace_tracked_value``, ``untrack``, ``add_to_store``,
    ``lock``/``unlock``). Public attribute assignment would append ``new`` at the end and
    keep tracking ``old``; Keras has no public way to replace a tracked sublayer.
    Checked: Keras 3.15.1.
    """
    tracker = owner._tracker
    locked = tracker.locked
    tracker.unlock()
    try:
        if tracker.is_in_store("layers", new):
            tracker.untrack(old)
        elif tracker.is_in_store("layers", old):
            tracker.replace_tracked_value("layers", old, new)
        else:
            tracker.add_to_store("layers", new)
    finally:
        if locked:
            tracker.lock()


# Attributes in which Keras itself keeps a layer's or a model's tracked state (lists of
# sublayers, variables, graph nodes, compiled losses and metrics). Code walking a layer's
# ``vars()`` for the sublayers *it* holds must skip them. Checked: Keras 3.15.1.
LAYER_STATE_ATTRIBUTES = frozenset(
    {
        "_layers", "_tracker", "_inbound_nodes", "_outbound_nodes", "_metrics", "_operations",
        "_trainable_variables", "_non_trainable_variables", "_seed_generators",
        "_compile_loss", "_compile_metrics", "_loss_tracker", "_functional",
    }
)  # fmt: skip


def is_functional(layer: Any) -> bool:
    """Whether ``layer`` is a Functional model (``keras.Model(inputs, outputs)`` or a
    subclass of ``Functional``).

    Uses ``keras.src.models.functional.Functional``: Keras 3 exports no alias of the class,
    and ``type(model).__name__`` misses subclasses. Checked: Keras 3.15.1.
    """
    from keras.src.models.functional import Functional

    return isinstance(layer, Functional)


def build_as_first_call(layer: keras.layers.Layer, args: tuple[Any, ...], kwargs: dict) -> None:
    """Build ``layer`` exactly as its first ``__call__`` on ``args``/``kwargs`` would (for a
    layer without ``build()``: one symbolic run of its call, which builds its sublayers under
    its name scope, then its build shapes recorded and the layer marked built), without then
    running the call once more for its output.

    Uses ``Layer._maybe_build`` inside ``Layer._open_name_scope``, with the
    ``keras.src.layers.layer.CallSpec`` that ``__call__`` makes from ``_call_signature`` and
    ``_call_context_args``. Keras has no public API to build a layer from sample inputs:
    ``build_from_config`` calls ``build()``, which builds nothing for such a layer, and a
    public call traces the layer's call twice (to build it, then for its output); on the
    benchmark's blocks that second trace was a third of a load. Checked: Keras 3.15.1.
    """
    from keras.src.layers.layer import CallSpec

    policy = layer.dtype_policy

    def convert(value: Any) -> Any:  # as ``__call__`` converts its inputs first
        return policy.convert_input(value, layer.autocast, layer.input_dtype)

    args = keras.tree.map_structure(convert, args)
    kwargs = keras.tree.map_structure(convert, dict(kwargs))
    spec = CallSpec(layer._call_signature, layer._call_context_args, args, kwargs)
    with layer._open_name_scope():
        layer._maybe_build(spec)


def forget_call_nodes(layer: keras.layers.Layer) -> None:
    """Forget every symbolic call of ``layer`` (its inbound and outbound graph nodes), so a
    Functional model later built around it numbers its nodes from zero.

    Uses ``Operation._inbound_nodes`` and ``_outbound_nodes``; Keras has no public API to
    remove graph nodes. Checked: Keras 3.15.1.
    """
    layer._inbound_nodes.clear()
    layer._outbound_nodes.clear()


def build_shapes(layer: keras.layers.Layer) -> dict[str, Any]:
    """The shapes ``layer.build`` was called with, by argument name (empty if unknown).

    Uses ``Layer._build_shapes_dict``. The public ``get_build_config()`` is not the same:
    layers may override it, and Keras' own lookup layers (``StringLookup``,
    ``IntegerLookup``) return ``{}`` from it although they were built with a shape.
    Checked: Keras 3.15.1.
    """
    return dict(getattr(layer, "_build_shapes_dict", None) or {})


# ----------------------------------------------------------------------------- losses
def take_losses(layer: keras.layers.Layer) -> list[Any]:
    """The losses ``add_loss`` and activity regularizers added during the calls of
    ``layer`` and its sublayers since they were last cleared; clears them.

    Uses ``Layer._losses`` and ``Layer._clear_losses``. The public ``layer.losses`` also
    evaluates every weight regularizer (new ops in a traced graph), and Keras has no public
    way to clear added losses. Checked: Keras 3.15.1.
    """
    losses: list[Any] = []
    for sub in sublayers(layer, include_self=True):
        losses.extend(sub._losses)
    layer._clear_losses()
    return losses


def add_losses(layer: keras.layers.Layer, losses: list[Any]) -> None:
    """Record ``losses`` as added during the current call of ``layer``, where ``take_losses``
    and ``layer.losses`` find them.

    Appends to ``Layer._losses``. The public ``add_loss`` is not usable for this: a
    Functional model's ``add_loss`` raises ``NotImplementedError``, and inside a stateless
    scope ``add_loss`` records nothing unless that scope collects losses.
    Checked: Keras 3.15.1.
    """
    layer._losses.extend(losses)


def clear_losses(layer: keras.layers.Layer) -> None:
    """Drop the losses added during the calls of ``layer`` and its sublayers.

    Uses ``Layer._clear_losses``; Keras clears them itself only at the start of its own
    ``__call__`` of the outermost layer, and has no public method for it.
    Checked: Keras 3.15.1.
    """
    layer._clear_losses()


@contextlib.contextmanager
def call_losses_kept(layer: keras.layers.Layer) -> Iterator[None]:
    """Whatever runs inside (tracing, which calls every layer and clears their losses)
    leaves the losses of the last eager call of ``layer`` and its sublayers as they were,
    so that saving a model does not empty its ``model.losses``.

    Reads and refills ``Layer._losses`` (see ``take_losses``). Checked: Keras 3.15.1.
    """
    saved = [(sub, list(sub._losses)) for sub in sublayers(layer, include_self=True)]
    try:
        yield
    finally:
        layer._clear_losses()
        for sub, losses in saved:
            sub._losses.extend(losses)


# -------------------------------------------------------------------------- variables
def own_variables(layer: keras.layers.Layer) -> list[Any]:
    """The variables ``layer`` itself tracks (trainable first, then non-trainable, then
    its seed generators' states), without those of its sublayers.

    Uses ``Layer._trainable_variables``, ``_non_trainable_variables`` and
    ``_seed_generators``. The public ``trainable_weights``/``non_trainable_weights``/
    ``variables`` include every sublayer's variables, and ``trainable_weights`` is empty
    for a frozen layer. Checked: Keras 3.15.1.
    """
    own = list(layer._trainable_variables) + list(layer._non_trainable_variables)
    return own + seed_generator_states(layer)


def seed_generator_states(layer: keras.layers.Layer) -> list[Any]:
    """The state variables of the ``keras.random.SeedGenerator`` objects ``layer`` itself
    holds: in ``layer.variables`` but not in ``layer.weights``, so a load must give them
    back as seed generators, not as weights.

    Uses ``Layer._seed_generators`` (no public API lists a layer's generators). Checked:
    Keras 3.15.1.
    """
    return [generator.state for generator in getattr(layer, "_seed_generators", [])]


def own_trainable_variables(layer: keras.layers.Layer) -> list[Any]:
    """The variables ``layer`` itself created trainable, without its sublayers' ones and
    whatever ``layer.trainable`` is now.

    Uses ``Layer._trainable_variables``; see ``own_variables``. Checked: Keras 3.15.1.
    """
    return list(layer._trainable_variables)


def track_variable(layer: keras.layers.Layer, variable: keras.Variable) -> None:
    """Make ``layer`` own an existing variable, as if it had created it.

    Uses ``Layer._track_variable``. ``add_weight`` always creates a new variable, and
    assigning the variable to an attribute would add that attribute to the layer.
    Checked: Keras 3.15.1.
    """
    layer._track_variable(variable)


def set_variable_storage(variable: keras.Variable, storage: tf.Variable) -> None:
    """Make an existing ``tf.Variable`` the storage of a Keras variable (no copy: reading,
    assigning and training the Keras variable then use ``storage``).

    Assigns ``KerasVariable._value``. Keras' ``keras.Variable(initializer=tf_variable)``
    copies the value into a new ``tf.Variable`` and ``assign`` copies values; no public
    API shares one storage. Reading it back is public: ``variable.value``.
    Checked: Keras 3.15.1, TensorFlow backend.
    """
    variable._value = storage


def variable_over_storage(
    storage: tf.Variable, *, name: str, trainable: bool, path: str | None = None
) -> keras.Variable:
    """A Keras variable over an existing ``tf.Variable`` (no copy: the same storage), for
    layers revived from traced functions (trainer SavedModels and legacy imports alike).
    ``path``: the saved variable's path (``block/dense/kernel``): the variable is created
    under the same name scopes, so ``variable.path`` is the saved one (code that pairs
    weights by path, an h5 save of the revived model)."""
    clean = re.sub(r"[/:]", "_", name) or "variable"
    with name_scopes(_scopes_of(path, clean)):
        variable = keras.Variable(
            initializer="zeros",
            shape=tuple(storage.shape),
            dtype=storage.dtype.name,
            trainable=trainable,
            name=clean,
        )
    set_variable_storage(variable, storage)
    return variable


def restore_variable_path(variable: keras.Variable, path: str) -> bool:
    """Give a variable rebuilt from its layer's config the path it was saved under;
    whether it did (only a path ending with the variable's own name is taken).

    A Keras variable's path is fixed when it is created, from the name scopes open then.
    Keras's deserialization builds a nested layer (the layer of a ``Wrapper``, the forward
    and backward layers of a ``Bidirectional``, an RNN's cell) from its build config
    before its parent builds, so outside the parent's scope: rebuilt, ``kernel`` of
    ``wrapper/dense`` becomes ``dense/kernel`` (Keras's own ``.keras`` load does the
    same), at any depth of nesting and whether or not the layer was built before it was
    wrapped. Assigns ``KerasVariable._path``: no public API sets a path, and recreating
    the variable under the saved scopes would need the layer's build to run again.
    Checked: Keras 3.15.1.
    """
    parts = path.split("/")
    if parts[-1] != variable.name or not all(parts):
        return False
    variable._path = path
    return True


def _scopes_of(path: str | None, name: str) -> list[str]:
    """The name scopes a variable saved at ``path`` was created under (none when the path
    does not end with the variable's own name: then only the name is kept)."""
    parts = (path or "").split("/")
    return parts[:-1] if len(parts) > 1 and parts[-1] == name and all(parts) else []


@contextlib.contextmanager
def name_scopes(scopes: list[str]):
    """Keras name scopes, outermost first: variables created inside get ``a/b/<name>``."""
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(keras.name_scope(scope))
        yield


# ------------------------------------------------------------------------ saving
# Where Keras's own layers define load_own_variables only to handle quantized or LoRA
# variables (module names compared as strings, never imported).
_POSITIONAL_LOAD_MODULES = frozenset(
    {
        "keras.src.layers.layer",
        "keras.src.layers.core.dense",
        "keras.src.layers.core.einsum_dense",
        "keras.src.layers.core.embedding",
        "keras.src.layers.convolutional.base_conv",
    }
)


def loads_own_variables_by_position(layer: keras.layers.Layer) -> bool:
    """True if copying ``layer``'s own variables by position restores it exactly: its
    ``save_own_variables`` / ``load_own_variables`` only store and assign them in order, or
    (LoRA) would store less than they hold.

    Keras's ``Layer`` does that; ``Dense``, ``EinsumDense``, ``Embedding`` and the
    convolutions override it only for quantized or LoRA variables. With LoRA enabled, their
    ``save_own_variables`` merges the adapters into the kernel (re-quantized, if the layer
    is quantized) and ``load_own_variables`` sets both adapters to zero: the outputs come
    back (bar re-quantizing), the fine-tuning state does not (zero ``a`` and ``b`` get zero
    gradients, so the adapters never train again). Their variables, copied as they are,
    are that state. Public Keras does not say which overrides are of that kind, so this
    compares where the methods are defined with those private modules. Checked: Keras
    3.15.1; ``tests/_compat/test_canaries.py`` lists every Keras layer overriding
    ``load_own_variables`` and fails when a new one appears.
    """
    if merges_lora_when_saved(layer):
        return True
    quantized = getattr(layer, "quantization_mode", None) is not None
    return _own_variables_modules(layer) <= _POSITIONAL_LOAD_MODULES and not quantized


def merges_lora_when_saved(layer: keras.layers.Layer) -> bool:
    """True if ``layer`` is one of Keras's LoRA-capable layers with LoRA enabled, whose own
    ``save_own_variables`` would merge the adapters away (see above); its variables must be
    stored as they are instead."""
    lora = bool(getattr(layer, "lora_enabled", False))
    return lora and _own_variables_modules(layer) <= _POSITIONAL_LOAD_MODULES


def _own_variables_modules(layer: keras.layers.Layer) -> set[str]:
    cls = type(layer)
    return {cls.load_own_variables.__module__, cls.save_own_variables.__module__}


@contextlib.contextmanager
def unchanged_object_names() -> Iterator[None]:
    """Within the block, Keras objects created get their usual automatic names, but the
    counters behind those names are put back afterwards: objects made only to be inspected
    and dropped (a save rebuilding a layer from its config to see whether a load could) do
    not shift the names of the objects the user creates next (``dense_3`` for ``dense_2``).

    Uses ``keras.src.backend.common.global_state``'s ``object_name_uids``, the per-thread
    counter map ``keras.backend.get_uid`` and automatic names advance; Keras has a public
    ``reset_uids`` but no way to restore a previous state. Checked: Keras 3.15.1.
    """
    from keras.src.backend.common import global_state

    saved = global_state.get_global_attribute("object_name_uids")
    saved = None if saved is None else copy.copy(saved)  # a defaultdict(int)
    try:
        yield
    finally:
        global_state.set_global_attribute("object_name_uids", saved)


def raised_as_is(error: BaseException) -> BaseException:
    """``error``, marked so that Keras' call wrapper lets it through unchanged.

    Uses ``_keras_call_info_injected``, the mark ``keras.src.utils.traceback_utils.
    inject_argument_info_in_traceback`` sets on errors it already annotated. Without it,
    that wrapper (on by default: traceback filtering) raises a *new* error of the same
    class built from the message alone, ``from None``: the cause trainer chained (the
    TensorFlow error behind a refused call) is lost. No public API keeps it;
    ``keras.config.disable_traceback_filtering()`` is a process-wide user setting.
    Checked: Keras 3.15.1.
    """
    error._keras_call_info_injected = True
    return error
