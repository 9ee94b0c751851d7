"""Issue 17 (first save and export time): the savedmodel save traces and searches less,
without changing what revives.

- A root model revived as a graph (Functional, Sequential) is rebuilt from its config
  around its layers, and nothing else calls it in training mode: its training trace is
  no longer stored. Its layers keep both traces, and a layer revived from them (class
  missing) still trains and infers like the original.
- A root revived from its traced functions (subclassed, class missing) keeps both.
- ``tf.saved_model.save`` finds each node's functions by ``getattr`` over ``dir(node)``:
  a node lists only its own attributes (tf.Module's ``variables`` / ``submodules``
  properties each walked the whole subtree there), and every traced function is still
  found and stored.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

from tests.helpers.savedmodel_zoo import assert_trains_alike, classes_hidden
from trainer.save_backends import get_backend
from trainer.save_backends.savedmodel import layout
from trainer.save_backends.savedmodel.save import trace_cache

PKG = "trace_work"


@keras.saving.register_keras_serializable(PKG)
class NormBlock(layers.Layer):
    """``call`` without ``training``; its BatchNormalization still behaves differently."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = layers.Dense(units)
        self.norm = layers.BatchNormalization(momentum=0.5)

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build((*input_shape[:-1], self.units))

    def call(self, x):
        return self.norm(self.dense(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(PKG)
class NormModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = NormBlock(4)
        self.head = layers.Dense(1)

    def call(self, x, training=None):
        return self.head(self.block(x, training=training))


def _functional():
    inputs = keras.Input((6,))
    return keras.Model(inputs, layers.Dense(1)(NormBlock(4, name="block")(inputs)))


def _sequential():
    return keras.Sequential([keras.Input((6,)), NormBlock(4, name="block"), layers.Dense(1)])


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")


def _save(model, tmp_path):
    x, y = _data()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    return get_backend("savedmodel").save(model, tmp_path / "ckpt")


def _records(path):
    return {r["name"]: r for r in layout.read_metadata(path)["savedmodel"]["layers"]}


@pytest.mark.parametrize("build", [_functional, _sequential], ids=["functional", "sequential"])
def test_graph_root_stores_no_training_trace_and_its_layers_still_train(build, tmp_path):
    model = build()
    path = _save(model, tmp_path)
    records = _records(path)
    root = records[model.name]
    assert set(root["functions"]) == {"call_infer"}
    assert set(records["block"]["functions"]) >= {"call_infer", "call_train"}
    loaded = tf.saved_model.load(str(path))
    assert not hasattr(loaded.layer_nodes[0], "call_train")
    assert hasattr(loaded.layer_nodes[records["block"]["id"]], "call_train")

    known = get_backend("savedmodel").load(path).model
    with classes_hidden(["NormBlock"], PKG):
        checkpoint = get_backend("savedmodel").load(path)
    revived = checkpoint.model
    assert checkpoint.metadata["revived_from"]["block"] == "traced"
    x, y = _data()
    # the same fit (training=True through the revived block) moves the same statistics
    assert_trains_alike(known, revived, x, y)
    assert not np.allclose(revived(x, training=True).numpy(), revived(x, training=False).numpy())
    served = loaded.signatures["serving_default"]
    (output,) = served(**{served.structured_input_signature[1].popitem()[0]: x}).values()
    np.testing.assert_allclose(output.numpy(), model(x, training=False).numpy(), atol=1e-6)


def test_subclassed_root_keeps_its_training_trace(tmp_path):
    model = NormModel()
    model(np.zeros((2, 6), "float32"))
    path = _save(model, tmp_path)
    assert set(_records(path)[model.name]["functions"]) >= {"call_infer", "call_train"}
    x, _ = _data()
    with classes_hidden(["NormBlock", "NormModel"], PKG):
        checkpoint = get_backend("savedmodel").load(path)
    assert checkpoint.metadata["revived_from"][model.name] == "traced"
    for training in (False, True):
        np.testing.assert_allclose(
            checkpoint.model(x, training=training).numpy(),
            model(x, training=training).numpy(),
            atol=1e-5,
            err_msg=f"training={training}",
        )


def test_nodes_list_only_their_own_attributes_and_every_function_is_stored(tmp_path):
    model = _functional()
    path = _save(model, tmp_path)
    root = trace_cache.cached(model).traced.root
    loaded = tf.saved_model.load(str(path))
    function_types = (tf.types.experimental.PolymorphicFunction,)
    for node, saved in zip(root.layer_nodes, loaded.layer_nodes, strict=True):
        own = sorted(vars(node))
        assert dir(node) == own  # no tf.Module property (variables, submodules) in it
        assert "variables" not in dir(node) and "submodules" not in dir(node)
        functions = [n for n in own if isinstance(getattr(node, n), function_types)]
        for name in functions:
            assert callable(getattr(saved, name, None)), f"{node.name}.{name} not stored"
    assert callable(loaded.serve) and "serving_default" in loaded.signatures


def test_serving_export_stores_inference_traces_and_its_revival_refuses_training(tmp_path):
    """A serving export traces each layer for inference only (a third of its time). Revived
    without the class, a layer whose training behaviour differs serves exactly and refuses
    ``training=True`` (it would otherwise train through its inference trace, silently
    another model); an export with the optimizer keeps the training traces."""
    from trainer.errors import RevivedCallError
    from trainer.exports.exporter import export_serving

    model = _functional()
    _save(model, tmp_path)
    x, y = _data()
    serving = export_serving(model, tmp_path / "serving", keep=1)
    record = _records(serving)["block"]
    assert set(record["functions"]) == {"call_infer"} and record["training_traced"] is False
    with classes_hidden(["NormBlock"], PKG):
        revived = get_backend("savedmodel").load(serving, compile=False).model
        np.testing.assert_allclose(revived(x).numpy(), model(x).numpy(), atol=1e-6)
        with pytest.raises(RevivedCallError, match=r"serving export.*--with-optimizer"):
            revived(x, training=True)
        revived.compile(keras.optimizers.SGD(0.05), "mse")
        with pytest.raises(RevivedCallError, match="training=True"):
            revived.fit(x, y, epochs=1, batch_size=8, verbose=0)

    known = get_backend("savedmodel").load(serving, compile=False).model  # class known
    np.testing.assert_allclose(
        known(x, training=True).numpy(), model(x, training=True).numpy(), atol=1e-6
    )

    tunable = export_serving(model, tmp_path / "tunable", keep=1, with_optimizer=True)
    assert set(_records(tunable)["block"]["functions"]) >= {"call_infer", "call_train"}
    with classes_hidden(["NormBlock"], PKG):
        revived = get_backend("savedmodel").load(tunable).model
        np.testing.assert_allclose(
            revived(x, training=True).numpy(), model(x, training=True).numpy(), atol=1e-5
        )
