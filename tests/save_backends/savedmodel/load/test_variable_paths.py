"""Issues 38 and 42: the variable paths of wrapped layers survive a savedmodel load.

Keras builds a layer nested in another one's config (the layer of a ``Wrapper``, the
forward and backward layers of a ``Bidirectional``, the ``Dense`` of a
``SpectralNormalization``) while deserializing its parent, before the parent's name scope
is open, so the rebuilt ``kernel`` of ``example_wrapper/dense`` came back as
``dense/kernel`` (Keras's own ``.keras`` load does the same). The savedmodel loader gives
every variable it binds the path it was saved under: ``[v.path for v in model.weights]``
is the original's, for a Functional model, a subclassed model whose class is given, and
one revived from its traces with its class missing (``peer_model/bidirectional/...``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.save_backends import get_backend

PKG = "varpaths"
register = keras.saving.register_keras_serializable(PKG)
X = np.random.default_rng(0).normal(size=(2, 4, 3)).astype("float32")


@register
class ExampleWrapper(layers.Wrapper):
    """The smallest ``keras.layers.Wrapper``: calls the layer it wraps."""

    def call(self, x):
        return self.layer(x)


def _stack():
    """A wrapped Dense, a spectrally normalized Dense, a Bidirectional LSTM."""
    return (
        ExampleWrapper(layers.Dense(5)),
        layers.SpectralNormalization(layers.Dense(4)),
        layers.Bidirectional(layers.LSTM(3)),
    )


@register
class Holder(keras.Model):
    """A subclassed model: its layers are built inside its own name scope."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.wrapped, self.normalized, self.both_ways = _stack()

    def call(self, x):
        return self.both_ways(self.normalized(self.wrapped(x)))


def _functional():
    inputs = keras.Input((4, 3))
    wrapped, normalized, both_ways = _stack()
    return keras.Model(inputs, both_ways(normalized(wrapped(inputs))), name="functional")


def _subclassed():
    model = Holder(name="peer_model")
    model(X)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each model, saved once through savedmodel."""
    keras.utils.set_random_seed(7)
    root = tmp_path_factory.mktemp("variable_paths")
    models = {"functional": _functional(), "subclassed": _subclassed()}
    backend = get_backend("savedmodel")
    return {name: (m, backend.save(m, root / name)) for name, m in models.items()}


def _assert_same(original, loaded):
    assert [v.path for v in loaded.weights] == [v.path for v in original.weights]
    assert [v.path for v in loaded.variables] == [v.path for v in original.variables]
    for a, b in zip(original.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    np.testing.assert_allclose(loaded(X), original(X), atol=1e-6)


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_wrapped_layers_keep_their_paths(saved, kind):
    original, path = saved[kind]
    # The originals hold the wrappers' prefixes that a rebuild from config loses.
    assert any("/dense" in v.path and v.path.count("/") >= 2 for v in original.weights)
    loaded = get_backend("savedmodel").load(path, compile=False).model
    _assert_same(original, loaded)


def test_revived_model_keeps_the_paths_of_its_wrapped_layers(saved):
    """Class missing: the model is revived from its traces, the Keras wrappers it holds
    are rebuilt from their configs, under ``peer_model/``."""
    original, path = saved["subclassed"]
    with classes_hidden(["Holder"], package=PKG):
        loaded = get_backend("savedmodel").load(path, compile=False).model
    assert type(loaded) is not Holder
    assert all(v.path.startswith("peer_model/") for v in loaded.weights)
    _assert_same(original, loaded)
