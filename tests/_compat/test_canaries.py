"""``trainer._compat.keras`` and ``trainer._compat.tensorflow``: each helper still does what
trainer relies on in the installed Keras and TensorFlow, each public replacement of a
private name behaves like the private name it replaced, and canaries for the workarounds
of Keras bugs.

A canary fails when upstream changed: ``test_multiworker_keras_bugs_still_present`` fails
once Keras fixes a multi-worker bug (then drop the workaround in ``trainer/_compat/keras_bugs.py``)
or when an installed Keras still has the bugs but is not covered by the version guard
(then add its minor version to ``MULTIWORKER_BUGS_IN``).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import handle_data_util
from tensorflow.python.trackable.resource import CapturableResource

from tests.helpers.paths import CHILDREN_DIR
from tests.helpers.processes import subprocess_env
from tests.helpers.workers import free_ports
from trainer._compat import keras as keras_compat
from trainer._compat import keras_bugs
from trainer._compat import keras_inputs as inputs_compat
from trainer._compat import keras_training as training_compat
from trainer._compat import tensorflow as tf_compat
from trainer._compat.initializers import DeferredInitializers
from trainer.save_backends.savedmodel.features import keras_objects
from trainer.save_backends.savedmodel.save import layer_functions, tracing

CHILD_TIMEOUT = 600  # hang guard for the two workers, never a speed check


class Block(keras.layers.Layer):
    """A custom layer holding sublayers, its own weight and a seed generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(3)
        self.second = keras.layers.Dense(2)
        self.dropout = keras.layers.Dropout(0.5)
        self.noise = keras.random.SeedGenerator(1)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="n")

    def call(self, inputs, training=None):
        return self.second(self.dropout(self.first(inputs), training=training)) * self.scale


class NoTraining(keras.layers.Layer):
    def call(self, inputs):
        return inputs


class Losses(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(keras.ops.sum(inputs))
        return inputs


def built(layer, shape=(2, 4)):
    layer(np.ones(shape, "float32"))
    return layer


# --------------------------------------------------------------------------- layers
def test_sublayers_and_tracked_sublayers():
    block = built(Block())
    assert keras_compat.sublayers(block, recursive=False) == [
        block.first,
        block.second,
        block.dropout,
    ]
    assert keras_compat.sublayers(block, include_self=True)[0] is block
    outer = keras.Sequential([keras.Input((4,)), block])
    assert block.first in keras_compat.sublayers(outer)  # nested, at any depth
    dense = keras.layers.Dense(4)
    twice = keras.Sequential([keras.Input((4,)), dense, dense])
    assert keras_compat.tracked_sublayers(twice).count(dense) == 2  # as tracked: repeats kept
    assert keras_compat.sublayers(twice, recursive=False).count(dense) == 1


def test_replace_tracked_sublayer_keeps_the_position():
    block = built(Block())
    new = keras.layers.Dense(3)
    keras_compat.replace_tracked_sublayer(block, block.first, new)
    assert keras_compat.tracked_sublayers(block) == [new, block.second, block.dropout]


def test_layer_state_attributes_are_where_keras_keeps_its_state():
    x, y = np.ones((4, 4), "float32"), np.ones((4, 2), "float32")
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    for model in (sequential, functional):
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, verbose=0)
    names = set(vars(sequential)) | set(vars(functional)) | set(vars(sequential.layers[0]))
    assert names >= keras_compat.LAYER_STATE_ATTRIBUTES


def test_is_functional():
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))

    class Subclass(keras.Model):  # the Functional API inside a subclass
        def __init__(self):
            inputs = keras.Input((4,))
            super().__init__(inputs, keras.layers.Dense(2)(inputs))

    class Plain(keras.Model):
        def call(self, inputs):
            return inputs

    assert keras_compat.is_functional(functional)
    assert keras_compat.is_functional(Subclass())
    assert not keras_compat.is_functional(keras.Sequential([keras.layers.Dense(2)]))
    assert not keras_compat.is_functional(Plain())
    assert not keras_compat.is_functional(keras.layers.Dense(2))


def test_forget_call_nodes():
    dense = keras.layers.Dense(2)
    dense(keras.Input((4,)))
    assert dense._inbound_nodes
    keras_compat.forget_call_nodes(dense)
    assert dense._inbound_nodes == [] and dense._outbound_nodes == []


class _NoBuild(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3)

    def call(self, x):
        return self.inner(x)


def test_build_as_first_call_builds_like_the_first_call():
    """Same variables, paths, build config and built flag as a first call, and no graph
    node (the call's output is never computed)."""
    called, built_here = _NoBuild(name="called"), _NoBuild(name="built_here")
    called(keras.Input((4,)))
    keras_compat.build_as_first_call(built_here, (keras.KerasTensor((None, 4)),), {})
    assert built_here.built and built_here.inner.built
    assert [v.path.split("/", 1)[0] for v in built_here.weights] == ["built_here"] * 2
    assert [v.shape for v in built_here.weights] == [v.shape for v in called.weights]
    assert built_here.get_build_config() == called.get_build_config()
    assert built_here._inbound_nodes == []


def test_unchanged_object_names_puts_the_name_counters_back():
    first = keras.layers.Dense(1).name
    with keras_compat.unchanged_object_names():
        inside = [keras.layers.Dense(1).name for _ in range(3)]
    after = keras.layers.Dense(1).name
    assert len(set(inside)) == 3 and first not in inside
    assert after == inside[0]  # the name the first Dense inside the block had


def test_build_shapes_where_get_build_config_says_nothing():
    dense = built(keras.layers.Dense(2))
    assert keras_compat.build_shapes(dense) == {"input_shape": (2, 4)}
    assert dense.get_build_config() == {"input_shape": (2, 4)}
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
    lookup(tf.constant([["a"]]))
    assert keras_compat.build_shapes(lookup) == {"input_shape": (1, 1)}
    assert lookup.get_build_config() == {}  # why the public API does not replace it
    assert keras_compat.build_shapes(keras.layers.Dense(2)) == {}


# --------------------------------------------------------------------------- losses
def test_take_losses_returns_added_losses_and_clears_them():
    model = keras.Sequential(
        [keras.Input((4,)), Losses(), keras.layers.Dense(2, activity_regularizer="l2")]
    )
    model(np.ones((2, 4), "float32"))
    assert len(model.losses) == 2
    taken = keras_compat.take_losses(model)
    assert len(taken) == 2 and model.losses == []
    model(np.ones((2, 4), "float32"))
    keras_compat.clear_losses(model)
    assert model.losses == []


def test_add_losses_also_on_functional_models():
    """tracing.Dispatcher re-adds a traced child's losses, and the child may be a
    Functional model, whose public ``add_loss`` refuses."""
    inputs = keras.Input((3,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises(NotImplementedError):
        functional.add_loss(tf.constant(1.0))  # why the public API does not replace it

    @tf.function
    def run(x):
        functional(x)
        keras_compat.add_losses(functional, [tf.reduce_sum(x)])
        return keras_compat.take_losses(functional)

    (loss,) = run(tf.ones((2, 3)))
    assert float(loss) == 6.0


# ------------------------------------------------------------------------ variables
def test_optimizer_built_for_and_uses_weight_decay_read_what_keras_set():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[model.layers[1].kernel], var_names=["bias"])
    optimizer.build(model.trainable_variables[:3])
    assert training_compat.optimizer_built_for(optimizer) == model.trainable_variables[:3]
    decayed = [training_compat.uses_weight_decay(optimizer, v) for v in model.trainable_variables]
    assert decayed == [True, False, False, False]  # kernel, bias, the listed kernel, bias


def test_own_variables_exclude_sublayers_and_ignore_freezing():
    block = built(Block())
    own = keras_compat.own_variables(block)
    expected = [block.scale, block.count, block.noise.state]  # not the sublayers' ones
    assert [id(v) for v in own] == [id(v) for v in expected]
    block.trainable = False
    assert keras_compat.own_trainable_variables(block) == [block.scale]
    assert block.trainable_weights == []  # why the public API does not replace it


def test_set_variable_storage_shares_the_tf_variable():
    storage = tf.Variable(np.full((2,), 3.0, "float32"))
    variable = keras.Variable(initializer="zeros", shape=(2,), dtype="float32")
    keras_compat.set_variable_storage(variable, storage)
    assert variable.value is storage and keras_objects.tf_variable(variable) is storage
    variable.assign([1.0, 2.0])
    np.testing.assert_array_equal(storage.numpy(), [1.0, 2.0])
    layer = keras.layers.Layer()
    keras_compat.track_variable(layer, variable)
    assert layer.weights == [variable] and layer.trainable_weights == [variable]


def test_restore_variable_path_sets_what_path_reads():
    """Keras still builds a wrapped layer outside its wrapper's scope when deserializing,
    and ``path`` still reads the attribute the helper sets; a path not ending with the
    variable's name is refused."""
    wrapper = keras.layers.TimeDistributed(keras.layers.Dense(2, name="inner"), name="outer")
    wrapper.build((1, 3, 4))
    config = keras.saving.serialize_keras_object(wrapper)
    kernel = keras.saving.deserialize_keras_object(config).layer.kernel
    assert wrapper.layer.kernel.path == "outer/inner/kernel"
    assert kernel.path == "inner/kernel"  # the loss the helper repairs
    assert keras_compat.restore_variable_path(kernel, "outer/inner/kernel")
    assert kernel.path == "outer/inner/kernel"
    assert not keras_compat.restore_variable_path(kernel, "elsewhere/bias")
    assert kernel.path == "outer/inner/kernel"


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_public_value_is_the_storage_keras_holds(policy):
    """``keras_objects.variable_storage`` reads the public ``variable.value``: the same object as
    Keras' private ``_value``, for layer and optimizer variables and any dtype policy."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype=policy)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    for variable in [*model.variables, *model.optimizer.variables]:
        assert keras_objects.variable_storage(variable) is variable._value
        assert isinstance(variable._value, tf.Variable)
    plain = tf.Variable(1.0)
    assert keras_objects.variable_storage(plain) is plain


def test_takes_training_matches_what_keras_derived():
    inputs = keras.Input((4,))
    layers = [
        keras.layers.Dense(2),
        keras.layers.Dropout(0.1),
        keras.layers.BatchNormalization(),
        keras.Sequential([keras.layers.Dense(2)]),
        keras.Model(inputs, keras.layers.Dense(2)(inputs)),
        Block(),
        NoTraining(),
        Losses(),
    ]
    for layer in layers:
        expected = layer._call_has_context_arg["training"]
        assert keras_objects.takes_training(layer) is expected, layer
        with tracing.CallRecorder([layer]):  # call replaced on the instance meanwhile
            assert keras_objects.takes_training(layer) is expected, layer


def test_trackable_resource_finds_what_capturable_resource_found():
    """``tracing.trackable_resources`` matches the public TrackableResource where it matched
    the private CapturableResource: the tables of every Keras lookup layer."""
    adapted = keras.layers.StringLookup()
    adapted.adapt(["a", "b"])
    vectorizer = keras.layers.TextVectorization(max_tokens=5)
    vectorizer.adapt(["a b", "c"])
    layers = [
        keras.layers.StringLookup(vocabulary=["a", "b"]),
        keras.layers.IntegerLookup(vocabulary=[1, 2]),
        keras.layers.IntegerLookup(),
        keras.layers.Hashing(4),
        keras.layers.TextVectorization(max_tokens=5, vocabulary=["a", "b"]),
        adapted,
        vectorizer,
    ]
    found = 0
    for layer in layers:
        for sub in keras_compat.sublayers(layer, include_self=True):
            private = [
                item
                for value in vars(sub).values()
                for item in (value if isinstance(value, list | tuple) else [value])
                if isinstance(item, CapturableResource | tf.saved_model.Asset)
            ]
            assert tracing.trackable_resources(sub) == private, sub
            found += len(private)
    assert found >= 7  # the comparison did see tables


# ----------------------------------------------------------------------- tensorflow
def test_spec_names_match_the_names_tf_function_gives():
    """``layer_functions.named`` must name specs as ``tf.function`` does, or the save traces
    every layer again; ``keras.tree`` paths would not (namedtuple fields as positions)."""
    pair = collections.namedtuple("Pair", "b a")
    spec = tf.TensorSpec([None, 2])
    args = (pair(spec, spec), collections.OrderedDict(z=spec, a=spec), [spec, [spec, None]])
    kwargs = {"mask": spec, "flag": True}
    function = tf.function(lambda args, kwargs: tf.nest.flatten(args)[0])
    traced_args, traced_kwargs = function.get_concrete_function(
        args, kwargs
    ).structured_input_signature[0]

    def names(structure):
        return [s.name for s in tf.nest.flatten(structure) if isinstance(s, tf.TensorSpec)]

    assert names(layer_functions.named(args, "args")) == names(traced_args)
    assert names(layer_functions.named(kwargs, "kwargs")) == names(traced_kwargs)
    assert "args_0_b" in names(traced_args)
    keras_paths = [path for path, _ in keras.tree.flatten_with_path(args)]
    assert (0, 0) in keras_paths and (0, "b") not in keras_paths


def test_saving_context_lets_the_save_reuse_traces(tmp_path):
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    spec = tf.TensorSpec([None], name="x")
    retraced = {}
    for inside in (True, False):
        module = tf.Module()
        module.double = tf.function(lambda x: x * 2.0)
        if inside:
            with tf_compat.saving_context(options):
                module.double.get_concrete_function(spec)
        else:
            module.double.get_concrete_function(spec)
        before = module.double.experimental_get_tracing_count()
        tf.saved_model.save(module, str(tmp_path / str(inside)), options=options)
        retraced[inside] = module.double.experimental_get_tracing_count() - before
    assert retraced == {True: 0, False: 1}


def test_concrete_functions_of_traced_and_loaded_functions(tmp_path):
    module = tf.Module()
    module.double = tf.function(lambda x: x * 2.0)
    first = module.double.get_concrete_function(tf.TensorSpec([None], name="x"))
    second = module.double.get_concrete_function(tf.TensorSpec([None, 3], name="x"))
    traced = tf_compat.concrete_functions(module.double)
    assert [c.structured_input_signature for c in traced] == [
        first.structured_input_signature,
        second.structured_input_signature,
    ]
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf_compat.concrete_functions(tf.saved_model.load(str(tmp_path)).double)
    assert sorted(str(c.structured_input_signature) for c in loaded) == sorted(
        str(c.structured_input_signature) for c in traced
    )


def test_write_fingerprint_writes_what_the_save_wrote(tmp_path):
    module = tf.Module()
    module.variable = tf.Variable([1.0, 2.0])
    tf.saved_model.save(module, str(tmp_path))
    saved = tf.saved_model.experimental.read_fingerprint(str(tmp_path))
    os.remove(tmp_path / "fingerprint.pb")
    tf_compat.write_fingerprint(str(tmp_path))
    rewritten = tf.saved_model.experimental.read_fingerprint(str(tmp_path))
    assert rewritten.saved_model_checksum == saved.saved_model_checksum
    assert rewritten.checkpoint_hash == saved.checkpoint_hash


def test_fingerprint_for_new_variables_is_the_one_tensorflow_computes(tmp_path):
    """After the variables change under the same saved_model.pb, the derived fingerprint
    equals TensorFlow's own, field by field, but for the random uuid."""
    from tensorflow.core.protobuf import fingerprint_pb2

    module = tf.Module()
    module.variable = tf.Variable(np.arange(40, dtype="float32"))
    tf.saved_model.save(module, str(tmp_path))
    previous = (tmp_path / "fingerprint.pb").read_bytes()
    module.variable.assign(module.variable * 3.0 + 1.0)
    tf.train.Checkpoint(module).write(str(tmp_path / "variables" / "variables"))
    derived = fingerprint_pb2.FingerprintDef.FromString(
        tf_compat.fingerprint_for_new_variables(str(tmp_path), previous)
    )
    tf_compat.write_fingerprint(str(tmp_path))
    computed = fingerprint_pb2.FingerprintDef.FromString((tmp_path / "fingerprint.pb").read_bytes())
    old = fingerprint_pb2.FingerprintDef.FromString(previous)
    assert computed.checkpoint_hash != old.checkpoint_hash  # the variables did change
    assert derived.uuid and derived.uuid != old.uuid
    for fingerprint in (derived, computed):
        fingerprint.ClearField("uuid")
    assert derived == computed


def test_exported_variable_handles_name_each_variables_own_node(tmp_path):
    """Variables named alike get handle nodes made unique in an order that is not the
    object graph's (``alpha`` was the second ``alpha`` here): the map says which is which."""
    from tensorflow.core.protobuf import saved_model_pb2

    module = tf.Module()
    module.a = tf.Variable([1.0, 2.0], name="alpha")
    module.b = [tf.Variable(3, name="beta"), tf.Variable([[1.0]], name="alpha")]
    variables = [module.a, *module.b]
    options = tf.saved_model.SaveOptions(experimental_skip_saver=True)
    with tf_compat.exported_variable_handles() as handles:
        tf.saved_model.save(module, str(tmp_path), options=options)
    graph = saved_model_pb2.SavedModel.FromString((tmp_path / "saved_model.pb").read_bytes())
    nodes = {n.name: n for n in graph.meta_graphs[0].graph_def.node}
    names = [handles[id(v)] for v in variables]
    assert len(set(names)) == 3
    for variable, name in zip(variables, names, strict=True):
        node = nodes[name]
        assert node.op == "VarHandleOp"
        assert [d.size for d in node.attr["shape"].shape.dim] == variable.shape.as_list()
        assert node.attr["dtype"].type == variable.dtype.as_datatype_enum
    with tf_compat.exported_variable_handles() as outside_thread:
        thread = threading.Thread(target=tf.saved_model.save, args=(module, str(tmp_path / "t")))
        thread.start()
        thread.join()
    assert outside_thread == {}  # another thread's save is not recorded here


def test_input_signature_of_a_built_model():
    model = keras.Sequential([keras.Input((4,), name="features"), keras.layers.Dense(2)])
    (structure,) = inputs_compat.get_input_signature(model)
    spec = tf.nest.flatten(structure)[0]
    tensor_spec = inputs_compat.make_tf_tensor_spec(spec, dynamic_batch=True)
    assert tensor_spec.shape.as_list() == [None, 4] and tensor_spec.dtype == tf.float32
    with pytest.raises(ValueError):
        inputs_compat.get_input_signature(keras.Sequential([keras.layers.Dense(2)]))


# ------------------------------------------------------------------ workaround canaries
def test_multiworker_workaround_guard():
    assert keras_bugs.multiworker_workarounds_needed((3, 15))
    assert not keras_bugs.multiworker_workarounds_needed((3, 16))
    installed = tuple(int(part) for part in keras.version().split(".")[:2])
    assert installed == keras_bugs.KERAS_RELEASE


@pytest.mark.slow
def test_multiworker_keras_bugs_still_present(tmp_path):
    """Canary for ``patch_multiworker_mean_reduction`` and ``build_from_example_batch``: two
    workers of a MultiWorkerMirroredStrategy on 127.0.0.1 run plain Keras into both bugs,
    then train with the workarounds."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    workers = []
    for index in range(2):
        env = subprocess_env()
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        command = [sys.executable, str(CHILDREN_DIR / "compat_multiworker_child.py")]
        workers.append(
            subprocess.Popen(
                command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )
        )  # fmt: skip
    reports = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=CHILD_TIMEOUT)
            assert worker.returncode == 0, err[-4000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    version = keras.version()
    for report in reports:
        reduce_error = report["reduce"]["error"] or ""
        assert "Invalid reduction dimension 0" in reduce_error, (
            f"Keras {version} reduces scalar step outputs under MultiWorkerMirroredStrategy "
            f"now: drop patch_multiworker_mean_reduction from trainer/_compat/keras_bugs.py. "
            f"Got {report['reduce']}"
        )
        build_error = report["build"]["error"] or ""
        assert "PerReplica" in build_error, (
            f"Keras {version} builds from a distributed batch under MultiWorkerMirroredStrategy "
            f"now: drop build_from_example_batch from trainer/_compat/keras_bugs.py. "
            f"Got {report['build']}"
        )
        assert "_maybe_symbolic_build" in report["build"]["frames"], report["build"]
        assert report["workarounds_needed"], (
            f"Keras {version} still has both multi-worker bugs but the workarounds are off: "
            f"add {keras_bugs.KERAS_RELEASE} to MULTIWORKER_BUGS_IN in "
            "trainer/_compat/keras_bugs.py"
        )
        assert report["patched"]["error"] is None, report["patched"]
        assert np.isfinite(report["patched"]["loss"])


def test_read_checkpoint_returns_the_object_graph_by_its_format_key(tmp_path):
    """The key names are TensorFlow's: a variable tracked as ``root.v`` is stored under
    ``v/.ATTRIBUTES/VARIABLE_VALUE`` and the object graph names that key."""
    root = tf.Module()
    root.v = tf.Variable([1.0, 2.0])
    prefix = tf.train.Checkpoint(root).write(str(tmp_path / "ckpt"))
    reader, graph = tf_compat.read_checkpoint(prefix)
    assert tf_compat.OBJECT_GRAPH_KEY == "_CHECKPOINTABLE_OBJECT_GRAPH"
    assert tf_compat.VARIABLE_VALUE == "VARIABLE_VALUE"
    children = {c.local_name: c.node_id for c in graph.nodes[0].children}
    (attribute,) = graph.nodes[children["v"]].attributes
    assert attribute.name == tf_compat.VARIABLE_VALUE
    assert attribute.checkpoint_key == "v/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_array_equal(reader.get_tensor(attribute.checkpoint_key), [1.0, 2.0])


def test_variables_reader_returns_values_that_later_updates_leave_unchanged():
    """One kernel reads every variable (float weights, Adam's slots, the int64 step count),
    and what it returned stays the value of that moment through the optimizer's in-place
    updates (TensorFlow copies a shared buffer before updating it)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    variables = [v.value for v in [*model.variables, *model.optimizer.variables]]
    assert {v.dtype for v in variables} >= {tf.float32, tf.int64}
    read = tf_compat.variables_reader(variables)
    assert read is not None
    values, expected = read(), [v.numpy() for v in variables]
    for value, wanted in zip(values, expected, strict=True):
        np.testing.assert_array_equal(value.numpy(), wanted)
    model.fit(x, y, epochs=1, verbose=0)
    variables[0].assign(tf.zeros_like(variables[0]))  # a whole-value assign, too
    assert (
        sum(not np.array_equal(v.numpy(), e) for v, e in zip(variables, expected, strict=True)) > 3
    )
    for value, wanted in zip(values, expected, strict=True):
        np.testing.assert_array_equal(value.numpy(), wanted)
    np.testing.assert_array_equal(read()[0].numpy(), np.zeros_like(expected[0]))


def test_call_flat_runs_the_concrete_function_with_its_flat_inputs():
    targets = [tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([], tf.int64))]

    @tf.function(autograph=False)
    def put(values):
        for target, value in zip(targets, values, strict=True):
            target.assign(value)
        return values[1] + 1

    specs = [tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.int64)]
    concrete = put.get_concrete_function(specs)
    out = tf_compat.call_flat(concrete, [tf.constant([1.0, 2.0]), tf.constant(7, tf.int64)])
    np.testing.assert_array_equal(targets[0].numpy(), [1.0, 2.0])
    assert targets[1].numpy() == 7 and int(np.asarray(out)) == 8


def test_variables_reader_values_survive_sparse_updates_too():
    """A sparse update (an embedding's gradient) switches a variable to copy-on-read mode,
    where updates no longer copy first: the reader's values must stay those of their read
    before that switch and in that mode."""
    table = tf.Variable(tf.zeros([10, 4]))
    read = tf_compat.variables_reader([table])
    rows = tf.IndexedSlices(tf.ones([2, 4]), tf.constant([1, 3]))
    (first,) = read()
    table.scatter_add(rows)  # the first sparse update: the mode changes
    (second,) = read()
    table.scatter_add(rows)
    np.testing.assert_array_equal(first.numpy(), np.zeros([10, 4]))
    assert second.numpy()[1, 0] == 1.0 and table.numpy()[1, 0] == 2.0


def test_deferred_initializers_start_at_zeros_and_initialize_what_got_no_value():
    calls = []

    def counted(shape, dtype=None):
        calls.append(tuple(shape))
        return keras.ops.full(shape, 3.0, dtype=dtype)

    with DeferredInitializers() as deferred:
        given = keras.Variable(initializer=counted, shape=(2, 3))
        rest = keras.Variable(initializer=counted, shape=(4,))
        shared = keras.Variable(initializer=counted, shape=(5,))
    assert calls == []  # nothing ran inside the block
    assert not np.any(given.numpy()) and not np.any(rest.numpy())
    given.assign(np.ones((2, 3), "float32"))
    keras_compat.set_variable_storage(shared, tf.Variable(np.full(5, 7.0, "float32")))
    assert deferred.initialize_rest([given]) == 1  # only ``rest`` had no value
    assert calls == [(4,)]
    np.testing.assert_array_equal(rest.numpy(), np.full(4, 3.0))
    np.testing.assert_array_equal(given.numpy(), np.ones((2, 3)))
    np.testing.assert_array_equal(shared.numpy(), np.full(5, 7.0))
    # Outside the block, and in another thread while a block is open, nothing is deferred.
    outside = keras.Variable(initializer=counted, shape=(1,))
    assert outside.numpy()[0] == 3.0
    seen = []
    with DeferredInitializers():
        thread = threading.Thread(
            target=lambda: seen.append(keras.Variable(initializer=counted, shape=(6,)).numpy())
        )
        thread.start()
        thread.join()
    np.testing.assert_array_equal(seen[0], np.full(6, 3.0))


def test_save_without_checkpoint_leaves_the_variables_to_the_caller(tmp_path):
    """The save writes everything but ``variables/``; a checkpoint of a module holding only
    the root's variable lists, under the same names, is what ``tf.saved_model.load`` then
    restores from (``savedmodel.variables_first``), also when written before the save."""
    module = tf.Module()
    module.model_variables = [tf.Variable([1.0, 2.0]), tf.Variable([[3]])]
    module.nodes = [tf.Module()]
    module.nodes[0].kernel = module.model_variables[0]  # a second path, as layer nodes have
    module.double = tf.function(
        lambda x: 2.0 * x * module.model_variables[0], input_signature=[tf.TensorSpec([2])]
    )
    holder = tf.Module()
    holder.model_variables = list(module.model_variables)
    tf.train.Checkpoint(holder).write(str(tmp_path / "variables" / "variables"))
    options = tf.saved_model.SaveOptions(experimental_skip_saver=True)
    assert tf_compat.save_without_checkpoint(module, str(tmp_path), None, options)
    assert sorted(os.listdir(tmp_path / "variables")) == [
        "variables.data-00000-of-00001",
        "variables.index",
    ]
    module.model_variables[0].assign([5.0, 7.0])  # after the write: not what loads
    loaded = tf.saved_model.load(str(tmp_path))
    assert loaded.model_variables[0].numpy().tolist() == [1.0, 2.0]
    assert loaded.nodes[0].kernel is loaded.model_variables[0]
    assert loaded.model_variables[1].numpy().tolist() == [[3]]
    assert loaded.double(tf.constant([1.0, 1.0])).numpy().tolist() == [2.0, 4.0]
    empty = tmp_path / "alone"
    assert tf_compat.save_without_checkpoint(module, str(empty), None, options)
    assert not (empty / "variables" / "variables.index").exists()


def _loop_outputs_with_handle_data(function: Any) -> list[bool]:
    """For each resource output of a ``While`` op in the graphs of a loaded function and
    of the functions they call: whether it has handle data."""
    found = []
    graphs = [c.graph for c in tf_compat.concrete_functions(function)]
    while graphs:
        graph = graphs.pop()
        for op in graph.get_operations():
            if op.type in ("While", "StatelessWhile"):
                resources = [t for t in op.outputs if t.dtype == tf.resource]
                found += [
                    bool(handle_data_util.get_resource_handle_data(t).shape_and_type)
                    for t in resources
                ]
            elif op.type in ("PartitionedCall", "StatefulPartitionedCall"):
                graphs.append(graph._get_function(op.get_attr("f").name).graph)
    return found


def test_restore_loop_handle_data_lets_a_loaded_loop_be_differentiated_both_ways(tmp_path):
    """A loaded ``tf.while_loop`` over a variable (in a ``tf.function`` that the saved one
    calls) lacks the handle data of its resource outputs, and a gradient taken eagerly
    then in a ``tf.function`` fails; with the helper, both give the same gradient. Fails
    once TensorFlow's loader keeps that handle data (then drop the helper)."""
    module = tf.Module()
    module.v = tf.Variable([1.0, 2.0])

    @tf.function
    def loop(x):
        return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * module.v), (0, x))[1]

    module.f = tf.function(lambda x: loop(x) + 1.0, input_signature=[tf.TensorSpec([2])])
    tf.saved_model.save(module, str(tmp_path))

    def gradient(loaded):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(loaded.f(tf.constant([1.0, 1.0])))
        return tape.gradient(y, loaded.v)

    broken = tf.saved_model.load(str(tmp_path))
    assert _loop_outputs_with_handle_data(broken.f) == [False]
    gradient(broken)
    with pytest.raises(ValueError, match="without handle data"):
        tf.function(gradient)(broken)

    loaded = tf.saved_model.load(str(tmp_path))
    tf_compat.restore_loop_handle_data(loaded.f)
    assert _loop_outputs_with_handle_data(loaded.f) == [True]
    eager = gradient(loaded).numpy()
    np.testing.assert_allclose(tf.function(gradient)(loaded).numpy(), eager)
    np.testing.assert_allclose(eager, [3.0, 12.0])  # d/dv sum(v**3 * 1 + 1) = 3 v**2


def test_an_error_raised_as_is_comes_through_a_keras_call_as_the_same_object():
    """Keras' call wrapper re-raises a marked error itself (its attributes kept), where it
    would raise a new one of the same class built from the message alone."""
    raised = []

    class Failing(keras.layers.Layer):
        def call(self, x):
            error = keras_compat.raised_as_is(ValueError("refused"))
            error.detail = "kept"
            raised.append(error)
            raise error

    with pytest.raises(ValueError, match=r"^refused$") as caught:
        Failing()(np.ones((1, 2), "float32"))
    assert caught.value is raised[0] and caught.value.detail == "kept"


def test_saving_with_custom_gradients_reuses_traces_made_without(tmp_path):
    """trainer traces inside ``saving_context(SAVE_OPTIONS)`` (custom gradients off) and
    saves a model whose traces use ``tf.custom_gradient`` with them on
    (``options.save_options``): the option must not be part of the trace cache key."""
    from trainer.save_backends.savedmodel.save import options as save_options

    module = tf.Module()

    @tf.custom_gradient
    def clipped(t):
        return tf.identity(t), lambda dy: tf.clip_by_value(dy, -0.1, 0.1)

    module.call = tf.function(lambda x: clipped(x) * 2.0)
    with tf_compat.saving_context(save_options.SAVE_OPTIONS):
        module.call.get_concrete_function(tf.TensorSpec([None], name="x"))
    before = module.call.experimental_get_tracing_count()
    options = save_options.save_options(tf_saver=True, gradients=True)
    tf.saved_model.save(module, str(tmp_path / "m"), options=options)
    assert module.call.experimental_get_tracing_count() == before
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    x = tf.constant([3.0, -3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(loaded.call(x))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [0.1, 0.1])  # 2.0 clipped
