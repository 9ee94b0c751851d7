"""Model structures a checkpoint must give back as they were (found by a probe of model
structures through every backend)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.callbacks import Checkpoint
from trainer.errors import ModelNotReadyError
from trainer.save_backends import get_backend

BACKENDS = ("savedmodel", "h5", "weights")
RNG = np.random.default_rng(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dict_outputs_keep_their_order(backend, tmp_path):
    """Configs were stored with sorted keys: outputs {"zout", "aout"} came back as
    ["aout", "zout"], and the per-output losses evaluate reports were swapped."""
    keras.utils.set_random_seed(0)
    zeta, alpha = keras.Input((3,), name="zeta"), keras.Input((2,), name="alpha")
    joined = keras.layers.Concatenate()([zeta, alpha])
    outputs = {
        "zout": keras.layers.Dense(3, name="zout")(joined),
        "aout": keras.layers.Dense(2, name="aout")(joined),
    }
    model = keras.Model({"zeta": zeta, "alpha": alpha}, outputs)
    model.compile("adam", {"zout": "mse", "aout": "mae"})
    x = {"zeta": RNG.normal(size=(8, 3)), "alpha": RNG.normal(size=(8, 2))}
    y = {"zout": np.zeros((8, 3)), "aout": np.ones((8, 2))}
    model.train_on_batch(x, y)
    loaded = get_backend(backend).load(get_backend(backend).save(model, tmp_path / "c")).model
    assert list(loaded(x)) == ["zout", "aout"]
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)


@keras.saving.register_keras_serializable("test_structure_fidelity")
class Scaled(keras.layers.Layer):
    """Multiplies by ``scale``, an attribute its config does not hold."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = 1.0

    def call(self, x):
        return x * self.scale


@keras.saving.register_keras_serializable("test_structure_fidelity")
class Shifted(keras.layers.Layer):
    """Adds ``alpha``, a constructor argument its get_config leaves out."""

    def __init__(self, alpha=1.0, **kwargs):
        super().__init__(**kwargs)
        self.alpha = alpha

    def call(self, x):
        return x + self.alpha

    def get_config(self):
        return super().get_config()  # alpha forgotten (Keras' own would have kept it)


def _model(layer: keras.layers.Layer) -> keras.Model:
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(layer(inputs)))
    model.compile("adam", "mse")
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["attribute", "constructor_argument"])
def test_state_a_config_loses_is_refused_at_save(backend, case, tmp_path):
    """A rebuild from the config computed with scale 1.0 / alpha 1.0, silently, in every
    backend (sync and async: the async shadow is rebuilt from the config too)."""
    if case == "attribute":
        layer = Scaled()
        layer.scale = 3.0
        match = r"attribute 'scale' is 3\.0, but a copy rebuilt .* has 1\.0"
    else:
        layer = Shifted(alpha=2.0)
        match = r"attribute 'alpha' is 2\.0, but a copy rebuilt .* has 1\.0"
    model = _model(layer)
    with pytest.raises(ModelNotReadyError, match=match):
        get_backend(backend).save(model, tmp_path / "ckpt")
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(ModelNotReadyError, match=match):  # an async save: refused in fit
        model.fit(
            RNG.normal(size=(8, 4)),
            RNG.normal(size=(8, 2)),
            verbose=0,
            callbacks=[Checkpoint(tmp_path / "run", backend=backend, async_save=True)],
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_attributes_the_config_carries_are_not_refused(backend, tmp_path):
    layer = Shifted()  # alpha 1.0: what the config rebuilds
    model = _model(layer)
    x = RNG.normal(size=(8, 4))
    loaded = get_backend(backend).load(get_backend(backend).save(model, tmp_path / "c")).model
    np.testing.assert_array_equal(loaded(x), model(x))


@keras.saving.register_keras_serializable("test_structure_fidelity")
class Affine(keras.layers.Layer):
    def build(self, input_shape):
        self.k = self.add_weight(shape=(input_shape[-1], 3), initializer="glorot_uniform")
        self.b = self.add_weight(shape=(3,), initializer="zeros")

    def call(self, x):
        return x @ self.k + self.b


def test_a_frozen_layer_revived_from_traces_trains_once_unfrozen(tmp_path):
    """Its variables came back non-trainable for good: unfrozen, it stayed out of
    trainable_weights and training silently skipped it."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(
        inputs, keras.layers.Dense(1)(Affine(name="affine", trainable=False)(inputs))
    )
    model.compile("adam", "mse")
    x, y = RNG.normal(size=(16, 4)), RNG.normal(size=(16, 1))
    model.train_on_batch(x, y)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["Affine"], "test_structure_fidelity"):
        checkpoint = get_backend("savedmodel").load(path)
    assert checkpoint.metadata["revived_from"]["affine"] == "traced"
    loaded = checkpoint.model
    assert len(loaded.trainable_weights) == len(model.trainable_weights) == 2  # still frozen
    for each in (model, loaded):
        each.get_layer("affine").trainable = True
        each.compile("adam", "mse")
        for _ in range(3):
            each.train_on_batch(x, y)
    assert len(loaded.trainable_weights) == len(model.trainable_weights) == 4
    for a, b in zip(model.variables, loaded.variables, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
