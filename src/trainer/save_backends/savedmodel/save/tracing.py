"""Tracing a Keras 3 model into a ``tf.Module`` tree that ``tf.saved_model.save`` can write.

Why this shape: the root must be a plain ``tf.Module`` (not the Keras model) so that a
process without trainer can load it, and every layer gets its own node holding *its*
``tf.Variable``s (the storage under the Keras variables, so each is stored once) and its
traced call functions. Layer call arguments are discovered by tracing the serving function
once while each layer's ``call`` is intercepted: the specs a parent really passes to its
children are recorded, the same idea as tf.keras' call collections, without re-deriving
shapes from build configs (which miss masks, multiple inputs and nested structures).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat import tensorflow as tf_compat
from trainer.model_state import readiness
from trainer.save_backends.savedmodel.features import masks
from trainer.save_backends.savedmodel.features.keras_objects import (
    takes_training,
    training_default,
)


class Node(tf.Module):
    """One layer in the object graph: variables, call functions, regularizer functions."""

    def __dir__(self) -> list[str]:
        """Only the attributes set on this node. ``tf.saved_model.save`` finds a module's
        functions by ``getattr`` over ``dir()``, several times per save; tf.Module's own
        properties (``variables``, ``trainable_variables``, ``submodules`` ...) each walk
        the whole subtree there, which made that search quadratic in the layers. No
        function is ever a class attribute of a node, so the same functions are found."""
        return sorted(vars(self))


def all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model and every sublayer at every depth, each once, parents before children."""
    return keras_compat.sublayers(model, include_self=True, recursive=True)


def training_matters(layer: keras.layers.Layer) -> bool:
    """Whether the layer can behave differently in training: its own ``call`` uses
    ``training``, or a sublayer's at any depth does. Keras hands ``training`` down to
    sublayers even through a parent whose ``call`` does not declare it (a block of Dense,
    Dropout and BatchNormalization), so such a parent needs a training trace too."""
    return any(_uses_training(x) for x in keras_compat.sublayers(layer, include_self=True))


def _uses_training(layer: keras.layers.Layer) -> bool:
    """Whether ``training`` can change what the layer's own ``call`` computes: it takes the
    argument, unless it is one of Keras' own classes whose ``call`` never reads it. Keras'
    ``Dense`` and ``EinsumDense`` declare ``training`` and ignore it, and by the signature
    alone every block of them got a second, identical trace. Keras' layers
    get ``training`` only as that argument (none of them reads the call context), so a body
    that never names it cannot depend on it. A user's ``call`` is taken at its signature."""
    if not takes_training(layer):
        return False
    cls = type(layer)
    if not cls.__module__.startswith("keras.src."):
        return True
    # A quantized layer runs ``_<mode>_call`` instead of ``call`` (Keras's ``quantized_call``):
    # a float8 Dense's reads ``training`` (it moves its scales and amax histories only then).
    mode = getattr(layer, "quantization_mode", None)
    quantized = getattr(cls, f"_{mode}_call", None) if isinstance(mode, str) else None
    return _body_names_training(cls.call) or (
        quantized is not None and _body_names_training(quantized)
    )


def unresolved_training_matters(layer: keras.layers.Layer) -> bool:
    """Whether a call leaving ``training`` unresolved (``model(x)`` or ``fit`` on a model
    whose ``call`` does not declare it: no argument, no outer call deciding it) can compute
    otherwise than ``training=False``. Keras then gives each sublayer its own default, and
    a sublayer defaulting to ``training=True`` (Keras' image augmentations, a user's layer)
    trains, with every layer after it in that call. Such a layer gets a third trace."""
    return any(_none_differs(x) for x in keras_compat.sublayers(layer, include_self=True))


def _none_differs(layer: keras.layers.Layer) -> bool:
    """Whether the layer's own ``call`` may act otherwise with ``training`` unresolved than
    with False: it defaults to a true value, or (a user's class) tests ``training`` against
    None. A stand-in revived with such a trace keeps it when saved again."""
    if live_objects.get_marker(layer, live_objects.TRACED_DEFAULT_CALL) is not None:
        return True
    if not takes_training(layer):
        return False
    default = training_default(layer)
    if default is not inspect.Parameter.empty and default is not None and default is not False:
        return True
    cls = type(layer)
    return not cls.__module__.startswith("keras.src.") and _body_tests_none(cls.call)


@functools.cache
def _body_tests_none(call: Callable) -> bool:
    """Whether the function compares ``training`` with None (``is None``, ``is not None``,
    ``== None``); True if its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(call)))
    except (OSError, TypeError, SyntaxError):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = any(isinstance(x, ast.Name) and x.id == "training" for x in operands)
            if named and any(isinstance(x, ast.Constant) and x.value is None for x in operands):
                return True
    return False


@functools.cache
def _body_names_training(call: Callable) -> bool:
    """Whether the function's body names ``training`` (or reads ``locals()`` / ``vars()``,
    which could pass it on); True if its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(call)))
    except (OSError, TypeError, SyntaxError):
        return True
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        return True
    for statement in function.body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Name) and node.id in ("training", "locals", "vars"):
                return True
    return False


# ----------------------------------------------------------------------- call recording
def _to_spec(value: Any) -> Any:
    """The spec a layer's call functions are traced with for one argument: a ragged or
    sparse tensor keeps its kind (``tf.RaggedTensorSpec`` / ``tf.SparseTensorSpec``),
    so the revived layer takes the same tensors as the original, not dense ones."""
    if isinstance(value, tf.RaggedTensor | tf.SparseTensor):
        return tf.type_spec_from_value(value)
    if isinstance(value, tf.Tensor | tf.Variable) or keras.ops.is_tensor(value):
        return tf.TensorSpec(value.shape, value.dtype)
    return value


def _spec_key(args: Any, kwargs: Any) -> str:
    return repr(tf.nest.map_structure(lambda s: s, (args, sorted(kwargs.items()))))


class CallRecorder:
    """Intercept ``layer.call`` on every layer while the serving function is traced; for
    a layer overriding ``__call__``, what its ``__call__`` receives instead (its override
    would otherwise run twice: before the recorded ``call`` inputs and in its trace)."""

    def __init__(self, layers: list[keras.layers.Layer]):
        self.layers = layers
        self.specs: dict[int, dict[str, tuple[Any, Any]]] = {id(x): {} for x in layers}
        # (first input, mask Keras hands to compute_mask) for layers with their own
        # compute_mask: what a revived layer's traced compute_mask is called with.
        self.mask_specs: dict[int, dict[str, tuple[Any, Any]]] = {id(x): {} for x in layers}
        self.restorers: list[Callable[[], None]] = []
        self.class_only: set[int] = set()  # layers that get no traced call functions

    def __enter__(self) -> CallRecorder:
        for layer in self.layers:
            if readiness.overrides_call(layer):
                # On a subclass made for this instance (``live_objects.patch_method``).
                patched = live_objects.patch_method(layer, "__call__", self._recording(layer))
            else:
                patched = live_objects.patch_method(layer, "call", self._wrap(layer, layer.call))
                if converts_before_call(layer):  # and what its __call__ is fed
                    self.restorers.append(patched)
                    patched = live_objects.patch_method(layer, "__call__", self._recording(layer))
            self.restorers.append(patched)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self.restorers:
            self.restorers.pop()()

    def snapshot(self) -> tuple[dict[int, dict[str, Any]], ...]:
        """What is recorded so far, for ``restore``."""
        return tuple({k: dict(v) for k, v in r.items()} for r in (self.specs, self.mask_specs))

    def restore(self, snapshot: tuple[dict[int, dict[str, Any]], ...]) -> None:
        """Back to ``snapshot``: after a trace that failed part way, the layers it reached
        hold specs no trace could take (floats for a layer gathering rows by ids)."""
        self.specs, self.mask_specs = ({k: dict(v) for k, v in r.items()} for r in snapshot)

    def _record(self, layer: keras.layers.Layer, args: Any, kwargs: Any) -> None:
        clean = {k: v for k, v in kwargs.items() if k != "training"}
        spec = (
            tf.nest.map_structure(_to_spec, tuple(args)),
            tf.nest.map_structure(_to_spec, clean),
        )
        for variant in masks.spec_variants(*spec, args, clean):  # and the input masks
            self.specs[id(layer)].setdefault(_spec_key(*variant), variant)
        if has_own_compute_mask(layer) and args:
            mask = kwargs.get("mask")
            if mask is None:
                mask = tf.nest.map_structure(keras_compat.keras_mask, args[0])
            mask_spec = tf.nest.map_structure(_to_spec, (args[0], mask))
            self.mask_specs[id(layer)].setdefault(repr(mask_spec), mask_spec)

    def _wrap(self, layer: keras.layers.Layer, call: Callable) -> Callable:
        def recording_call(*args: Any, **kwargs: Any) -> Any:
            self._record(layer, args, kwargs)
            return call(*args, **kwargs)

        return recording_call

    def _recording(self, layer: keras.layers.Layer) -> Callable[..., Any]:
        """A ``__call__`` for the layer (set on this instance only, while recording) that
        records its arguments, then runs its class's own."""
        original = type(layer)
        recorder = self

        def __call__(instance: Any, *args: Any, **kwargs: Any) -> Any:
            recorder._record(layer, args, kwargs)
            return original.__call__(instance, *args, **kwargs)

        return __call__


def converts_before_call(layer: keras.layers.Layer) -> bool:
    """Whether one of Keras' own classes between the layer's and ``Layer`` overrides
    ``__call__``: Keras' preprocessing layers (``TFDataLayer``) convert every input to
    their compute dtype there when called inside a TF graph, so their ``call`` receives
    float32 images where the model feeds them int64 ones. Traced with what ``call``
    received only, a layer revived from its traces could not take what the rebuilt graph
    feeds it; traced with what ``__call__`` received too, its trace does that conversion
    itself. (A user's ``__call__`` override is recorded at ``__call__`` level alone.)"""
    own = type(layer).__call__
    return own is not keras.layers.Layer.__call__ and not readiness.overrides_call(layer)


def is_dropout_cell(layer: keras.layers.Layer) -> bool:
    """Whether ``layer`` is an RNN cell with dropout (Keras' ``DropoutRNNCell`` mixin,
    which caches the masks it draws on the cell)."""
    rates = (getattr(layer, "dropout", 0), getattr(layer, "recurrent_dropout", 0))
    is_cell = hasattr(layer, "reset_recurrent_dropout_mask")
    return is_cell and any(isinstance(r, int | float) and r > 0 for r in rates)


def uses_parent_dropout_masks(layer: keras.layers.Layer) -> bool:
    """Whether the layer's ``call`` reads dropout masks a parent drew for it: an RNN draws
    its cell's dropout masks once per call and leaves them on the cell (Python state, read
    at every step). Dispatched to its own traced function, a cell cannot see them: that
    function draws fresh masks at every step (more draws from the seed generator, other
    masks than the original's). Such a cell (or a layer holding one outside an RNN, such
    as ``StackedRNNCells``) is left out of dispatch, so its parent's trace holds its Python
    code and the masks the parent drew."""
    if is_dropout_cell(layer):
        return True
    if isinstance(layer, keras.layers.RNN):  # draws its cells' masks in its own call
        return False
    children = keras_compat.sublayers(layer, recursive=False)
    return any(uses_parent_dropout_masks(child) for child in children)


# ----------------------------------------------------------------------- function makers
def _read_variables(structure: Any) -> Any:
    """Variables passed as call arguments, read into tensors: a traced function takes
    tensors (a stateful RNN passes its ``states`` variables to its cell's first step)."""

    def read(value: Any) -> Any:
        if isinstance(value, keras.Variable | tf.Variable):
            return tf.convert_to_tensor(value)
        return value

    return tf.nest.map_structure(read, structure)


class Dispatcher:
    """While active, a call to an already traced layer runs its traced function instead of
    re-tracing its Python ``call``: a parent's graph then holds one call op per child, so
    each layer's ops are traced and stored once per ``training`` value, not once per
    ancestor (the idea of tf.keras' child-call replacement). The child's activity
    regularizer is muted meanwhile, as its traced function already returns that loss.
    """

    def __init__(self) -> None:
        # layer, inference, training and unresolved-training traces, its regularizer
        self.entries: dict[int, tuple[keras.layers.Layer, Any, Any, Any, Any]] = {}
        self.restorers: dict[int, Callable[[], None]] = {}  # of the installed calls

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer, _infer, _train, regularizer, _default in self.entries.values():
            self._uninstall(layer)
            layer.activity_regularizer = regularizer

    def add(self, layer: keras.layers.Layer, infer: Any, train: Any, default: Any = None) -> None:
        self.entries[id(layer)] = (layer, infer, train, layer.activity_regularizer, default)
        self._install(layer)

    def _install(self, layer: keras.layers.Layer) -> None:
        _, infer, train, _, default = self.entries[id(layer)]
        takes_masks = masks.accepts_masks(infer)

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            training = kwargs.pop("training", None)
            if training is None:  # a call without ``training``: Keras passes it by context
                training = keras_compat.outer_training()
            if takes_masks:
                kwargs = masks.with_masks(args, kwargs)
            function = infer
            if train is not None and isinstance(training, bool) and training:
                function = train
            elif training is None and default is not None:
                function = default
            args, kwargs = _read_variables((tuple(args), kwargs))
            outputs, losses = masks.received(function(args, kwargs))
            keras_compat.add_losses(layer, list(losses))
            return outputs

        self._uninstall(layer)  # installed once at most: its restorer gives the class's back
        self.restorers[id(layer)] = live_objects.patch_method(layer, "call", dispatch)
        layer.activity_regularizer = None

    def _uninstall(self, layer: keras.layers.Layer) -> None:
        restore = self.restorers.pop(id(layer), None)
        if restore is not None:
            restore()

    def own_call(self, layer: keras.layers.Layer) -> Any:
        """Context in which ``layer`` itself runs its Python code (for its own traces)."""
        dispatcher = self

        class _Own:
            def __enter__(self_inner) -> None:
                if id(layer) in dispatcher.entries:
                    dispatcher._uninstall(layer)
                    layer.activity_regularizer = dispatcher.entries[id(layer)][3]

            def __exit__(self_inner, *exc: Any) -> None:
                if id(layer) in dispatcher.entries:
                    dispatcher._install(layer)

        return _Own()


def make_call_function(
    layer: keras.layers.Layer,
    training: bool | None,
    dispatcher: Dispatcher | None = None,
    *,
    unresolved: bool = False,
) -> Any:
    """``fn(args, kwargs) -> (outputs, losses)``: the layer's ``__call__`` at a fixed
    ``training`` value. Losses added during the call (activity regularizers, ``add_loss``)
    are returned rather than left behind as graph tensors on the layer.

    ``unresolved``: called with ``training=None``, what Keras resolves a call to when no
    argument, outer call or non-None default decides it (the layer's ``call`` then gets
    None, its sublayers their own defaults): one behaviour, whatever led to it.
    """
    ref = weakref.ref(layer)  # the cache must not keep the model alive
    dispatcher_ref = weakref.ref(dispatcher) if dispatcher is not None else None

    def call(args, kwargs):
        target = ref()
        kwargs = masks.attach(args, kwargs)  # the masks its inputs carried, back on them
        if training is not None or unresolved:
            kwargs["training"] = training
        active = dispatcher_ref() if dispatcher_ref is not None else None
        own = contextlib.nullcontext() if active is None else active.own_call(target)
        with own, _fresh_dropout_masks(target):
            outputs = target(*args, **kwargs)
        return masks.returned(outputs, keras_compat.take_losses(target))

    return tf.function(call)


@contextlib.contextmanager
def _fresh_dropout_masks(layer: keras.layers.Layer) -> Iterator[None]:
    """A dropout cell traced on its own draws its masks in its own graph and caches them
    on the cell; left there, they would be found by its RNN's next trace (a tensor of
    another graph, which the save refuses). Cleared before and after its own trace."""
    if not is_dropout_cell(layer):
        yield
        return
    layer.reset_dropout_mask()
    layer.reset_recurrent_dropout_mask()
    try:
        yield
    finally:
        layer.reset_dropout_mask()
        layer.reset_recurrent_dropout_mask()


def make_regularizer_function(variable: Any) -> Any:
    ref = weakref.ref(variable)

    def regularization_loss():
        var = ref()
        return var.regularizer(var)

    return tf.function(regularization_loss).get_concrete_function()


def has_own_compute_mask(layer: keras.layers.Layer) -> bool:
    """Whether the layer's class overrides ``Layer.compute_mask``: only then does a layer
    revived without its class need a traced ``compute_mask`` to produce the same masks."""
    return type(layer).compute_mask is not keras.layers.Layer.compute_mask


def make_compute_mask_function(layer: keras.layers.Layer) -> Any:
    """``fn(inputs, mask) -> output mask``: the layer's ``compute_mask`` as Keras calls it
    after ``call`` (first input, and the mask that came with it)."""
    ref = weakref.ref(layer)

    def compute_mask(inputs, mask):
        return ref().compute_mask(inputs, mask)

    return tf.function(compute_mask)


def make_activity_function(layer: keras.layers.Layer, spec: tf.TensorSpec) -> Any:
    ref = weakref.ref(layer)

    def activity_regularization_loss(outputs):
        return ref().activity_regularizer(outputs)

    return tf.function(activity_regularization_loss).get_concrete_function(spec)


# Lookup tables (``tf.lookup.StaticHashTable``, ``MutableHashTable``) and other resources
# that need initialization are TrackableResources, as are resources loaded from a SavedModel.
_RESOURCE_TYPES = (tf.saved_model.experimental.TrackableResource, tf.saved_model.Asset)


def trackable_resources(layer: keras.layers.Layer) -> list[Any]:
    """TF resources (lookup tables, assets) a layer holds outside Keras variables; a traced
    function that captures them can only be saved if the object graph reaches them. A
    layer revived from traces also reaches those its loaded functions capture (the tables
    of a ``StringLookup`` it owned, restored with the SavedModel): no layer holds them."""
    found = []
    for value in list(vars(layer).values()):
        candidates = value if isinstance(value, list | tuple) else [value]
        for item in candidates:
            if isinstance(item, _RESOURCE_TYPES):
                found.append(item)
            elif live_objects.get_marker(layer, live_objects.REVIVED_FROM) and _is_function(item):
                found.extend(tf_compat.captured_resources(item))
    unique = {id(item): item for item in found}  # a table two functions capture: once
    return list(unique.values())


def _is_function(value: Any) -> bool:
    return isinstance(
        value, tf.types.experimental.GenericFunction | tf.types.experimental.ConcreteFunction
    )
