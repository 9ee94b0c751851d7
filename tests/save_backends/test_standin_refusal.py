"""Issue 18: a model holding a layer revived from trainer's own traced functions (class
missing at load) is refused by the backends that store configs and weights only.

Measured before the refusal: such a model saved through h5 / weights, and the load in the
process that saved it raised MissingClassError; with the class registered it still did
(the stored config names trainer's stand-in module and the bare class name, not the
class's registered name), and only ``custom_objects={"Name": cls}`` loaded it. The
savedmodel backend keeps the traces and reloads it exactly.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.checkpointing import AsyncBackend
from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend

PKG = "h16refusal"


@keras.saving.register_keras_serializable(PKG)
class Scaled(keras.layers.Layer):
    """A custom layer with a sublayer and a weight of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(3,), initializer="ones", name="scale")

    def call(self, x):
        return self.inner(x) * self.scale


@pytest.fixture(scope="module")
def revived(tmp_path_factory):
    """The model reloaded by the savedmodel backend without its custom class."""
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(Scaled(name="scaled")(inputs)))
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("own") / "sm")
    with classes_hidden(["Scaled"], PKG):
        back = get_backend("savedmodel").load(path, compile=False).model
    assert type(back.get_layer("scaled")).__module__.endswith("standins")  # a stand-in
    return back


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_config_backends_refuse_trainers_own_standins(revived, tmp_path, backend):
    target = tmp_path / "ckpt"
    message = r"'scaled' \(Scaled\).*trainer SavedModel.*savedmodel backend.*Received: .*scaled"
    with pytest.raises(ModelNotReadyError, match=message):
        get_backend(backend).save(revived, target)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_savedmodel_backend_keeps_them(revived, tmp_path):
    x = np.random.default_rng(0).random((4, 2)).astype("float32")
    path = get_backend("savedmodel").save(revived, tmp_path / "sm")
    with classes_hidden(["Scaled"], PKG):
        back = get_backend("savedmodel").load(path, compile=False).model
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(revived(x)))


def test_async_saves_refuse_in_the_call_that_asked(revived, tmp_path):
    """Through the async wrapper (the default of checkpoint callbacks) the refusal comes
    from ``save`` itself, in the caller's thread, not from the writer thread at some later
    save; nothing is written and the wrapper stays usable."""
    backend = AsyncBackend(get_backend("weights"))
    try:
        with pytest.raises(ModelNotReadyError, match=r"'scaled' \(Scaled\)"):
            backend.save(revived, tmp_path / "ckpt")
        backend.wait()  # no failure was left behind in the writer
        assert list(tmp_path.iterdir()) == []
    finally:
        backend.close()
