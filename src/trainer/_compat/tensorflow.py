"""TensorFlow internals that trainer needs and TensorFlow exposes no public API for.

Every helper names the private module or attribute it uses, why no public API does the
job, and the version it was checked against (TensorFlow 2.21.0). ``tests/_compat/test_canaries.py``
checks each helper against the behaviour it relies on.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2
from tensorflow.python.trackable import base as _trackable_base


def saving_context(options: tf.saved_model.SaveOptions) -> contextlib.AbstractContextManager:
    """The context ``tf.saved_model.save(..., options=options)`` traces functions in.

    The save context is part of ``tf.function``'s cache key: functions traced inside it
    are found again by the save, outside it the save traces every function a second time.
    Uses ``tensorflow.python.saved_model.save_context.save_context``; TensorFlow enters it
    only inside ``tf.saved_model.save``, with no public way to enter it beforehand.
    Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.saved_model import save_context

    return save_context.save_context(options)


def save_without_checkpoint(obj: Any, directory: str, signatures: Any, options: Any) -> bool:
    """``tf.saved_model.save`` that writes no ``variables/`` checkpoint, where the caller
    has written it already (``savedmodel.variables_first``); False, with nothing written,
    where this TensorFlow has no such save.

    Uses ``tensorflow.python.saved_model.save.save_and_return_nodes`` and its
    ``experimental_skip_checkpoint`` argument: the public ``tf.saved_model.save`` calls it
    without the argument, and no public option skips the checkpoint (``SaveOptions`` can
    skip only the SaverDef). The rest of the save is TensorFlow's own, the fingerprint
    included (which hashes the checkpoint the caller wrote). Checked: TensorFlow 2.21.0
    (``tests/_compat/test_canaries.py``).
    """
    from tensorflow.python.saved_model import save

    function = getattr(save, "save_and_return_nodes", None)
    if function is None or "experimental_skip_checkpoint" not in _parameters(function):
        return False
    function(obj, directory, signatures, options, experimental_skip_checkpoint=True)
    return True


def checkpoint_object_graph(root: Any) -> Any | None:
    """The ``TrackableObjectGraph`` proto ``tf.train.Checkpoint(root).write`` stores for
    ``root`` (passed positionally: ``root`` is the graph's root, with the ``root`` back
    reference the checkpoint adds), computed without writing anything; None where this
    TensorFlow lacks the call, or where ``root`` holds objects saved by registered savers
    (their entries are not plain tensors).

    Lets trainer write that checkpoint itself (``savedmodel.variables_first`` with
    ``tensor_bundle``): the keys and graph are TensorFlow's, only the writing is ours.
    Uses ``Checkpoint._saver._gather_serialized_tensors``, the call ``Checkpoint.write``
    itself makes to build the proto before handing the tensors to ``SaveV2``; no public
    API returns it. Checked: TensorFlow 2.21.0
    (``tests/save_backends/savedmodel/save/test_variables_first.py`` compares every entry and
    the object graph with what ``Checkpoint.write`` writes).
    """
    saver = getattr(tf.train.Checkpoint(root), "_saver", None)
    gather = getattr(saver, "_gather_serialized_tensors", None)
    if gather is None:
        return None
    _tensors, _feeds, registered_savers, proto = gather(None)
    return None if registered_savers else proto


def _parameters(function: Callable[..., Any]) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


_exported = threading.local()
_export_hook_lock = threading.Lock()
_export_hook_installed = False


@contextlib.contextmanager
def exported_variable_handles() -> Iterator[dict[int, str]]:
    """Within the block, a ``tf.saved_model.save`` in this thread records, for each plain
    ``tf.Variable`` it writes, the name of the ``VarHandleOp`` node standing for it in the
    SavedModel's graph; yields ``{id(variable): node name}``, filled when the save returns.

    A SaverDef (what TF Serving and the C++ and TF1 loaders run to restore the variables)
    is written by trainer itself (``savedmodel.saver_def``), and its restore op must assign
    each value to the right handle node. The graph names those nodes after the variables,
    made unique in an order that is not the object graph's, so names cannot be matched
    back; the save's own map from each variable to its copy in the exported graph says it.
    Uses ``tensorflow.python.saved_model.save._SaveableView.map_resources``, wrapped once
    per process; outside a block, and in other threads, it is unchanged. Checked:
    TensorFlow 2.21.0 (``tests/_compat/test_canaries.py``).
    """
    _install_export_hook()
    found: dict[int, str] = {}
    outer = getattr(_exported, "handles", None)
    _exported.handles = found
    try:
        yield found
    finally:
        _exported.handles = outer


def _install_export_hook() -> None:
    """Wrap ``map_resources`` once. Where this TensorFlow has no such method, nothing is
    wrapped: the map stays empty and the save keeps TensorFlow's own SaverDef."""
    global _export_hook_installed
    from tensorflow.python.saved_model import save

    with _export_hook_lock:
        if _export_hook_installed:
            return
        original = getattr(getattr(save, "_SaveableView", None), "map_resources", None)
        if original is None:
            _export_hook_installed = True
            return

        def map_resources(view: Any) -> Any:
            mapped = original(view)
            found = getattr(_exported, "handles", None)
            if found is not None:
                for source, copy in mapped[0].items():
                    if isinstance(source, tf.Variable) and hasattr(copy, "handle"):
                        found[id(source)] = copy.handle.op.name
            return mapped

        save._SaveableView.map_resources = map_resources
        _export_hook_installed = True


def op_defs(names: list[str]) -> list[Any]:
    """The registered ``OpDef`` of each op in ``names``: what a MetaGraphDef lists in its
    ``stripped_op_list`` for the ops its graph uses (nodes trainer adds to a SavedModel's
    graph must be listed there as TensorFlow's own are).

    Uses ``tensorflow.python.framework.op_def_registry.get``; no public API returns an
    op's definition. Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.framework import op_def_registry

    return [op_def_registry.get(name) for name in names]


def variables_reader(variables: list[tf.Variable]) -> Callable[[], list[tf.Tensor]] | None:
    """A function returning the value of every variable in ``variables``, read by one
    kernel run in the calling thread; None where that op is not available (the caller
    reads another way).

    What a read returns is a value: TensorFlow shares the variable's buffer with it and
    copies that buffer first if the variable is updated while the value is held (copy on
    write; ``tests/_compat/test_canaries.py`` checks it through an optimizer step). The async
    snapshot (issue 17) reads this way, so the training thread pays for no copy and no
    function call. Public reads are one eager op per variable (1.0 ms for 69 variables);
    a traced function holding the reads runs on TensorFlow's inter-op threads and waits
    for them (0.39 ms in training against 0.18 ms for this one op). Uses the registered
    op ``_ReadVariablesOp`` through ``tensorflow.python.eager.execute.execute``; its
    ``N`` and ``dtypes`` attributes must both be given (TensorFlow aborts the process
    without ``N``). Call it eagerly. Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.eager import context, execute
    from tensorflow.python.framework import op_def_registry

    if op_def_registry.get("_ReadVariablesOp") is None or not variables:
        return None
    count, handles = len(variables), [v.handle for v in variables]
    attrs = ("N", count, "dtypes", [v.dtype.as_datatype_enum for v in variables])

    def read() -> list[tf.Tensor]:
        ctx = context.context()
        return list(execute.execute("_ReadVariablesOp", count, handles, attrs, ctx))

    return read


def call_flat(function: Any, tensors: list[tf.Tensor]) -> Any:
    """Call the concrete function ``function`` with ``tensors``, its inputs flattened, in
    order, skipping the check ``ConcreteFunction.__call__`` makes of each argument against
    its spec in Python. The async snapshot's writer (issue 17) passes every variable's
    value (69 for the default model) at every save: the check was 0.49 ms of the call's
    0.54 ms CPU, called in a loop, and 1.24 ms in the writer thread during training. The
    caller guarantees the tensors match the specs it traced with (the values of the very
    variables the specs were taken from). Uses ``ConcreteFunction._call_flat(args,
    captured_inputs)``, what ``__call__`` ends in. Checked: TensorFlow 2.21.0.
    """
    return function._call_flat(tensors, function.captured_inputs)


def map_structure_with_tuple_paths(func: Callable[[tuple, Any], Any], structure: Any) -> Any:
    """``func(path, leaf)`` over a nested structure, paths as ``tf.function`` sees them.

    Uses ``tensorflow.python.util.nest.map_structure_with_tuple_paths``. ``tf.nest`` has
    no public variant with paths, and ``keras.tree.flatten_with_path`` differs from how
    ``tf.function`` names its placeholders: it gives a namedtuple's fields as positions
    (``args_0_0``) where ``tf.function`` uses the field names (``args_0_b``), and visits
    an ``OrderedDict`` in insertion order instead of sorted. Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.util import nest

    return nest.map_structure_with_tuple_paths(func, structure)


def concrete_functions(function: Any) -> list[Any]:
    """Every concrete function traced for a ``tf.function`` or one loaded with
    ``tf.saved_model.load``, in the order they were traced (loaded: as saved).

    Uses ``Function._list_all_concrete_functions``. The public API can only look a
    concrete function up by its input signature (``get_concrete_function``), which is
    what the callers want to find out; ``experimental_get_tracing_count`` only counts.
    Checked: TensorFlow 2.21.0.
    """
    return list(function._list_all_concrete_functions())


def captured_resources(function: Any) -> list[Any]:
    """The TF resources (lookup tables...) whose handles a ``tf.function`` or concrete
    function captures, each once: a function loaded from a SavedModel captures the
    restored tables, which no Keras layer holds, and saving it again needs them reachable
    in the object graph (else TensorFlow's "untracked resource" AssertionError).

    Uses ``Tensor._parent_trackable``, the weak reference TensorFlow itself follows from a
    captured handle to the resource owning it (``_get_trackable_parent_error_string``);
    no public API maps a captured tensor to its owner. Checked: TensorFlow 2.21.0.
    """
    if isinstance(function, tf.types.experimental.ConcreteFunction):
        functions = [function]
    else:
        functions = concrete_functions(function)
    found: dict[int, Any] = {}
    for concrete in functions:
        for tensor in concrete.captured_inputs:
            parent = getattr(tensor, "_parent_trackable", None)
            owner = parent() if callable(parent) else None
            if isinstance(owner, tf.saved_model.experimental.TrackableResource):
                found.setdefault(id(owner), owner)
    return list(found.values())


def write_fingerprint(directory: str) -> None:
    """Write ``fingerprint.pb`` for the SavedModel in ``directory`` (hashes of its
    ``saved_model.pb`` and variables), as ``tf.saved_model.save`` does.

    Uses ``tensorflow.python.saved_model.fingerprinting_utils.write_fingerprint``; the
    public ``tf.saved_model.experimental`` API only reads fingerprints. Raises whatever
    the import or the write raises. Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.saved_model import fingerprinting_utils

    fingerprinting_utils.write_fingerprint(directory)


def fingerprint_for_new_variables(
    directory: str, previous: bytes, index_hash: bytes | None = None
) -> bytes:
    """The ``fingerprint.pb`` of the SavedModel in ``directory``, given ``previous``: the
    fingerprint of a SavedModel with the same ``saved_model.pb`` and other variables (a
    repeat save writes the same graph bytes back). Only the checkpoint hash is computed,
    and a new uuid drawn; ``write_fingerprint`` would parse and hash ``saved_model.pb``
    again, which was most of its 3-4 ms on every repeat save.

    Relies on how TensorFlow fills ``FingerprintDef`` (``fingerprinting.cc``): the
    checkpoint hash is FarmHash ``Fingerprint64`` of ``variables/variables.index`` (what
    ``tf.fingerprint(..., method="farmhash64")`` computes for a one-string row, read little
    endian), the uuid a random 128-bit number in decimal, every other field a hash of
    ``saved_model.pb`` alone. ``tests/_compat/test_canaries.py`` compares the result with
    TensorFlow's own. ``index_hash``: that ``tf.fingerprint`` of the index (8 bytes), if the
    caller computed it already (the traced variables write does). Checked: TensorFlow 2.21.0.
    """
    from tensorflow.core.protobuf import fingerprint_pb2

    fingerprint = fingerprint_pb2.FingerprintDef()
    fingerprint.ParseFromString(previous)
    if index_hash is None:
        with open(os.path.join(directory, "variables", "variables.index"), "rb") as handle:
            index = handle.read()  # a local directory: trainer writes checkpoints with os
        index_hash = tf.fingerprint(tf.constant([index]), method="farmhash64").numpy()[0]
        index_hash = index_hash.tobytes()
    fingerprint.checkpoint_hash = int.from_bytes(index_hash, "little")
    fingerprint.uuid = str(secrets.randbits(128))
    return fingerprint.SerializeToString()


def capture_named(value: Any, name: str) -> Any:
    """Capture ``value`` (a tensor or resource handle from outside) into the
    ``tf.function`` graph being traced, as a placeholder named ``name``.

    A ``tf.function`` called inside another one has its captured inputs (variable
    handles) captured by the outer graph under TensorFlow's numeric unique ids, which a
    SavedModel signature cannot use as argument names: the save renames them and logs an
    absl INFO line listing every one. Capturing them first, under valid names, avoids
    both; a later capture of the same value reuses the placeholder. Uses
    ``FuncGraph.capture`` (``tensorflow.python.framework.func_graph``), which has no
    public equivalent. Checked: TensorFlow 2.21.0.
    """
    return tf.compat.v1.get_default_graph().capture(value, name=name)


# The key under which a TF2 checkpoint stores its object graph, and the attribute name of a
# variable's value in that graph. TensorFlow defines them in the private
# ``tensorflow.python.trackable.base`` (OBJECT_GRAPH_PROTO_KEY, VARIABLE_VALUE_KEY) and
# exports no public alias; reading a checkpoint by object path (our own SavedModels, the
# one-op variables writer, legacy tf.keras SavedModels) needs both. Taking TensorFlow's own
# constants means a format change shows up here, not as a silent key mismatch.
OBJECT_GRAPH_KEY: str = _trackable_base.OBJECT_GRAPH_PROTO_KEY
VARIABLE_VALUE: str = _trackable_base.VARIABLE_VALUE_KEY


def read_checkpoint(prefix: str) -> tuple[Any, Any]:
    """The ``tf.train.load_checkpoint`` reader of ``prefix`` and the checkpoint's parsed
    ``TrackableObjectGraph``. Raises what the reader or the protobuf parser raises (a
    missing or damaged file); each caller says what that means for its format."""
    reader = tf.train.load_checkpoint(prefix)
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader.get_tensor(OBJECT_GRAPH_KEY)
    )
    return reader, graph


def load_pruned_saved_model(proto: Any, directory: str, filters: list[str]) -> Any:
    """Import the nodes at ``filters`` (paths like ``root.layer_nodes.3``, with their
    descendants) of an in-memory SavedModel ``proto``, resolving assets in ``directory``,
    without restoring the checkpoint. Returns the loader: ``loader.get(node_id)`` is the
    loaded object of a node, ``None`` where the node was not loaded.

    Uses ``tensorflow.python.saved_model.load.Loader``. ``tf.saved_model.load`` (and
    ``tf.__internal__.saved_model.load_partial``) only read ``saved_model.pb`` from a
    directory and import its whole function library whatever the filters; a pruned proto
    must therefore be handed to the loader itself, which is what those functions do
    after parsing the file. Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.saved_model import load as _load

    options = tf.saved_model.LoadOptions(experimental_skip_checkpoint=True)
    graph = proto.meta_graphs[0].object_graph_def
    with tf.init_scope():
        return _load.Loader(
            graph, proto, directory, tf.train.CheckpointOptions(), options, list(filters)
        )


_LOOPS = ("While", "StatelessWhile")
_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
# Graphs already completed: a parent's graphs call its children's, visited once per load.
_LOOPS_RESTORED: weakref.WeakSet = weakref.WeakSet()


def restore_loop_handle_data(function: Any) -> None:
    """Give the resource outputs of every ``While`` op in the graphs of a function loaded
    from a SavedModel (and of the functions those graphs call) the handle data of the
    matching loop inputs, which the loader leaves out.

    A traced ``tf.while_loop`` whose body reads variables passes their handles through
    the loop, and ``while_v2`` copies the handles' dtype and shape onto the loop's outputs;
    a graph rebuilt from a ``FunctionDef`` has them on the inputs only. TensorFlow
    differentiates a concrete function called under a tape one way when eager and another
    when building a graph, each time making the loop's outputs side outputs of the
    function; the second way needs the dtype of each, and fails with "Tried to take
    gradients (or similar) of a variable without handle data" (a revived RNN trained one
    eager step then ``fit`` in a ``tf.function``, or with persistent and plain tapes).

    Uses ``tensorflow.python.ops.handle_data_util`` (reading and copying handle data) and
    ``Graph._get_function`` (the function a call op in a loaded graph runs, whose graph
    is the one TensorFlow differentiates for that op); there is no public API for either.
    Loops nested in loop bodies are left as loaded (their body graphs are rebuilt only
    when differentiated). Checked: TensorFlow 2.21.0.
    """
    from tensorflow.python.ops import handle_data_util

    if isinstance(function, tf.types.experimental.ConcreteFunction):
        pending = [function.graph]
    else:
        pending = [concrete.graph for concrete in concrete_functions(function)]
    while pending:
        graph = pending.pop()
        if graph in _LOOPS_RESTORED:
            continue
        _LOOPS_RESTORED.add(graph)
        for op in graph.get_operations():  # in creation order: a loop feeding a loop works
            if op.type in _LOOPS:
                resources = [
                    (s, t)
                    for s, t in zip(op.inputs, op.outputs, strict=True)
                    if t.dtype == tf.resource
                ]
                for source, target in resources:
                    data = handle_data_util.get_resource_handle_data(target)
                    if not (data.is_set and data.shape_and_type):
                        handle_data_util.copy_handle_data(source, target)
            elif op.type in _CALLS:
                called = graph._get_function(op.get_attr("f").name)
                if called is not None:
                    pending.append(called.graph)
