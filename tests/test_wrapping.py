"""wrap_model / unwrap_model on every kind of model, and magnitude pruning end to end.

Models are built here (tiny, random data) so the tests do not depend on the model zoo; the
zoo's resnet gets its own test at the end.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import pytest
import tensorflow as tf
from omegaconf import OmegaConf

from trainer import keras_state, wrapping
from trainer.errors import ConfigMismatchError, TrainerError
from trainer.pruning import (
    PolynomialSparsity,
    PruneLowMagnitude,
    PruningCallback,
    prunable,
    sparsity_report,
)
from trainer.wrapping import WrapHost, find_layers, unwrap_model, wrap_model

# Test blocks build lazily on first call, as many user layers do; Keras warns on reload.
pytestmark = pytest.mark.filterwarnings("ignore:`build\\(\\)` was called on layer")
CONF = os.path.join(os.path.dirname(__file__), os.pardir, "conf", "wrap")
L = keras.layers


# ------------------------------------------------------------------------ test layers
@keras.saving.register_keras_serializable(package="test_wrapping")
class Block(L.Layer):
    """Residual block holding Conv/BN/Dense sublayers as attributes (built lazily)."""

    def __init__(self, filters=4, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv = L.Conv2D(filters, 3, padding="same", use_bias=False)
        self.bn = L.BatchNormalization()
        self.gate = L.Dense(filters, activation="sigmoid")

    def call(self, x, training=None):
        y = keras.ops.relu(self.bn(self.conv(x), training=training))
        gate = self.gate(keras.ops.mean(y, axis=(1, 2)))
        return x + y * gate[:, None, None, :]

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


@keras.saving.register_keras_serializable(package="test_wrapping")
class Inner(L.Layer):
    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = L.Dense(units, activation="tanh")

    def call(self, x):
        return self.dense(x) + x

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="test_wrapping")
class Middle(L.Layer):
    """A list of custom layers plus a dict entry: paths with indices and keys."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.stack = [Inner(units), Inner(units)]
        self.heads = {"out": L.Dense(units)}

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        return self.heads["out"](x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="test_wrapping")
class Outer(L.Layer):
    """Three levels deep: Outer -> Middle -> Inner -> Dense, plus a Dense of its own."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.middle = Middle(units)
        self.proj = L.Dense(units)

    def call(self, x):
        return self.proj(self.middle(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="test_wrapping")
class Subclassed(keras.Model):
    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.classes = classes
        self.flatten = L.Flatten()
        self.hidden = [L.Dense(8, activation="relu"), L.Dense(8, activation="relu")]
        self.block = Inner(8)
        self.head = L.Dense(classes)

    def call(self, x):
        x = self.flatten(x)
        for layer in self.hidden:
            x = layer(x)
        return self.head(self.block(x))

    def get_config(self):
        return {"classes": self.classes, "name": self.name}


def sequential():
    return keras.Sequential(
        [keras.Input((6,)), L.Dense(8, activation="relu"), L.Dropout(0.1), L.Dense(3)]
    )


def residual(shared=False):
    inputs = keras.Input((8, 8, 2))
    x = L.Conv2D(4, 3, padding="same", name="stem")(inputs)
    first = Block(4, name="block_a")
    x = first(x)
    x = (first if shared else Block(4, name="block_b"))(x)
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, L.Dense(3, name="logits")(x))


def deep():
    inputs = keras.Input((4,))
    return keras.Model(inputs, L.Dense(2)(Outer(4, name="outer")(inputs)))


def subclassed():
    model = Subclassed(3, name="sub")
    model(np.zeros((1, 6), "float32"))
    return model


def prune(model, **kwargs):
    params = {"target_sparsity": 0.5, "begin_step": 0, "end_step": 8, "frequency": 2, **kwargs}
    return wrap_model(model, prunable(), lambda layer: PruneLowMagnitude(layer, **params))


def data(model, n=32, seed=0):
    rng = np.random.default_rng(seed)
    shape = (6,) if isinstance(model, Subclassed) else model.input_shape[1:]
    x = rng.normal(size=(n, *shape)).astype("float32")
    return x, rng.integers(0, 3, size=n)


def kernels(layer_types=(L.Dense, L.Conv2D)):
    return lambda model: [l for l in find_layers(model, L.Layer) if isinstance(l, layer_types)]


def plain_count(model):
    """Dense/Conv layers NOT inside a PruneLowMagnitude."""
    inside = {id(w.layer) for w in find_layers(model, PruneLowMagnitude)}
    return sum(id(l) not in inside for l in kernels()(model))


def same_outputs(a, b, x, atol=1e-5):
    np.testing.assert_allclose(a.predict(x, verbose=0), b.predict(x, verbose=0), atol=atol)


# ------------------------------------------------------------------- structural tests
@pytest.mark.parametrize("build", [sequential, residual, deep, subclassed])
def test_every_kernel_layer_is_wrapped_once_and_outputs_are_unchanged(build):
    model = build()
    before = len(kernels()(model))
    wrapped = prune(model)
    assert plain_count(wrapped) == 0
    assert len(find_layers(wrapped, PruneLowMagnitude)) == before
    # The caller's model is untouched: same layers, no wrapper anywhere.
    assert not find_layers(model, PruneLowMagnitude) and len(kernels()(model)) == before
    x, _ = data(model, 8)
    same_outputs(model, wrapped, x)


def test_nested_custom_layers_are_wrapped_at_every_depth_and_survive_a_config_round_trip():
    wrapped = prune(deep())
    outer = find_layers(wrapped, Outer)[0]
    assert isinstance(outer.proj, PruneLowMagnitude)
    assert isinstance(outer.middle.heads["out"], PruneLowMagnitude)
    assert all(isinstance(inner.dense, PruneLowMagnitude) for inner in outer.middle.stack)
    host = wrapped.get_layer("outer")
    assert isinstance(host, WrapHost)
    # Reload from config alone: the host re-applies every wrapper, weights line up by position.
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(wrapped))
    assert [tuple(v.shape) for v in clone.weights] == [tuple(v.shape) for v in wrapped.weights]
    assert len(find_layers(clone, PruneLowMagnitude)) == 5 and plain_count(clone) == 0
    for dst, src in zip(clone.weights, wrapped.weights, strict=True):
        dst.assign(src)
    x, _ = data(wrapped, 8)
    same_outputs(wrapped, clone, x)


def test_shared_block_is_wrapped_once_and_stays_shared():
    model = residual(shared=True)
    wrapped = prune(model)
    hosts = [l for l in wrapped.layers if isinstance(l, WrapHost)]
    assert len(hosts) == 1 and len(hosts[0]._inbound_nodes) == 2
    # stem + conv + gate (block shared) + logits: one wrapper each, not one per call site.
    assert len(find_layers(wrapped, PruneLowMagnitude)) == 4
    assert len(wrapped.weights) == len(model.weights) + 4 * 2  # mask + step per wrapper
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(wrapped))
    assert len(clone.weights) == len(wrapped.weights)
    block = find_layers(clone, Block)[0]
    assert len(find_layers(clone, Block)) == 1 and isinstance(block.conv, PruneLowMagnitude)
    plain = unwrap_model(wrapped)
    assert len(plain.weights) == len(model.weights) and len(find_layers(plain, Block)) == 1


def test_functional_layer_reused_at_two_call_sites_maps_to_one_wrapper():
    inputs = keras.Input((5,))
    dense = L.Dense(5, name="shared")
    model = keras.Model(inputs, dense(dense(inputs)))
    wrapped = prune(model)
    assert len(find_layers(wrapped, PruneLowMagnitude)) == 1
    wrapper = wrapped.get_layer("prune_shared")
    assert len(wrapper._inbound_nodes) == 2
    # One kernel drives both call sites: zeroing it through the wrapper zeroes the output.
    wrapper.layer.kernel.assign(np.zeros((5, 5), "float32"))
    wrapper.layer.bias.assign(np.ones(5, "float32"))
    np.testing.assert_allclose(wrapped.predict(np.ones((2, 5), "float32"), verbose=0), 1.0)


def test_subclassed_model_is_hosted_and_unwraps_to_its_own_class():
    model = subclassed()
    wrapped = prune(model)
    assert isinstance(wrapped.layers[-1], WrapHost) and wrapped.layers[-1].root
    plain = unwrap_model(wrapped)
    assert type(plain) is Subclassed and not find_layers(plain, PruneLowMagnitude)
    x, _ = data(model, 8)
    same_outputs(model, plain, x)


def test_wrapping_twice_does_not_double_wrap():
    once = prune(residual())
    twice = prune(once)
    assert len(find_layers(twice, PruneLowMagnitude)) == len(find_layers(once, PruneLowMagnitude))
    assert not any(isinstance(w.layer, PruneLowMagnitude) for w in find_layers(twice, PruneLowMagnitude))


def test_layer_tracked_outside_any_attribute_is_refused_clearly():
    @keras.saving.register_keras_serializable(package="test_wrapping")
    class Hidden(L.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._layers.append(L.Dense(2))

        def call(self, x):
            return self._layers[0](x)

    inputs = keras.Input((2,))
    model = keras.Model(inputs, Hidden(name="hidden")(inputs))
    with pytest.raises(TrainerError, match="no attribute"):
        prune(model, end_step=4)
