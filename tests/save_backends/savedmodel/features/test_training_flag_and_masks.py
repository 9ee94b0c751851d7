"""Issue 14, defects 6, 12 and 13: a layer revived from traced functions (class missing)
keeps its training behaviour and its masks.

- 6: Keras hands ``training`` to sublayers even through a layer or model whose ``call``
  does not declare it; the revived layer must still drop out and move BatchNormalization
  statistics during ``fit``.
- 12: a layer taking ``mask`` and called with extra keyword arguments revives.
- 13: a revived mask-producing layer computes the same mask, so a new model built from
  revived layers gives the same outputs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers, ops

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.errors import RevivedCallError
from trainer.save_backends import get_backend

PKG = "rtm"


@keras.saving.register_keras_serializable(PKG)
class NormBlock(layers.Layer):
    """``call`` without ``training``; its BatchNormalization still sees Keras' value."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = layers.Dense(units)
        self.norm = layers.BatchNormalization(momentum=0.5)

    def call(self, x):
        return self.norm(self.dense(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(PKG)
class DropBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(16)
        self.drop = layers.Dropout(0.5)

    def call(self, x):
        return self.drop(self.dense(x))


@keras.saving.register_keras_serializable(PKG)
class NormModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = NormBlock(4)
        self.head = layers.Dense(1)

    def call(self, x):
        return self.head(self.block(x))


@keras.saving.register_keras_serializable(PKG)
class MaskMaker(layers.Layer):
    """Masks out the time steps whose features sum to zero."""

    def call(self, x):
        return x * 2.0

    def compute_mask(self, x, mask=None):
        return ops.sum(ops.abs(x), axis=-1) > 0


@keras.saving.register_keras_serializable(PKG)
class GatedMean(layers.Layer):
    """Takes the mask, and an extra keyword argument a Functional graph passes along."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x, mask=None, scale=1.0):
        y = self.dense(x) * scale
        if mask is None:
            return ops.mean(y, axis=1)
        weights = ops.cast(mask, y.dtype)[..., None]
        return ops.sum(y * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1.0)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")


def _block_functional():
    inputs = keras.Input((6,))
    outputs = layers.Dense(1)(NormBlock(4, name="block")(inputs))
    return keras.Model(inputs, outputs)


def _saved(model, tmp_path, x, y):
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    return get_backend("savedmodel").save(model, tmp_path / "ckpt")


def _moving_statistics(model):
    return {v.path: v.numpy() for v in model.non_trainable_variables if "moving" in v.path}


@pytest.mark.parametrize("build", [_block_functional, NormModel], ids=["functional", "subclassed"])
def test_revived_block_without_training_argument_trains_like_the_original(build, tmp_path):
    x, y = _data()
    path = _saved(build(), tmp_path, x, y)
    known = get_backend("savedmodel").load(path).model
    with classes_hidden(["NormBlock", "NormModel"], PKG):
        revived = get_backend("savedmodel").load(path).model
    stand_ins = [x for x in revived._flatten_layers() if type(x).__module__.startswith("trainer")]
    assert {type(layer).__name__ for layer in stand_ins} & {"NormBlock", "NormModel"}

    # the same fit moves the same statistics and weights. Keras' fit passes training=True
    # only to a model whose call declares it: the Functional model trains its block's
    # BatchNormalization, the subclassed NormModel (call(x)) leaves it in inference mode.
    before = _moving_statistics(revived)
    for model in (known, revived):
        model.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)
    after = _moving_statistics(revived)
    moved = [not np.allclose(before[k], after[k]) for k in before]
    assert moved and all(moved) == (build is _block_functional) and len(set(moved)) == 1
    for a, b in zip(known.variables, revived.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=a.path)

    # training=True normalises by the batch statistics, not the moving ones
    np.testing.assert_allclose(
        known(x, training=True).numpy(), revived(x, training=True).numpy(), atol=1e-5
    )
    assert not np.allclose(revived(x, training=True).numpy(), revived(x, training=False).numpy())


def test_revived_block_without_training_argument_drops_out(tmp_path):
    inputs = keras.Input((6,))
    model = keras.Model(inputs, DropBlock(name="drop_block")(inputs))
    x, _ = _data()
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["DropBlock"], PKG):
        revived = get_backend("savedmodel").load(path).model
    assert type(revived.get_layer("drop_block")).__module__.startswith("trainer")
    inference = revived(x, training=False).numpy()
    np.testing.assert_allclose(inference, model(x, training=False).numpy(), atol=1e-5)
    trained = revived(x, training=True).numpy()
    dropped = trained == 0
    assert 0.2 < dropped.mean() < 0.8  # about half the units dropped
    np.testing.assert_allclose(trained[~dropped], 2.0 * inference[~dropped], rtol=1e-5)


def _masked_model():
    inputs = keras.Input((5, 3))
    masked = MaskMaker(name="mask_maker")(inputs)
    outputs = GatedMean(name="gated")(masked, scale=3.0)
    return keras.Model(inputs, outputs)


def _sequences():
    x = np.random.default_rng(1).normal(size=(4, 5, 3)).astype("float32")
    x[:, 3:] = 0.0  # the last two steps are padding: masked out
    x[0, 1:] = 0.0
    return x


def test_revived_mask_layers_keep_masks_and_extra_keyword_arguments(tmp_path):
    model = _masked_model()
    x = _sequences()
    expected = model(x).numpy()
    unmasked = GatedMean.call(model.get_layer("gated"), model.get_layer("mask_maker")(x), scale=3.0)
    assert not np.allclose(expected, unmasked.numpy(), atol=1e-3)  # the mask matters here
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["MaskMaker", "GatedMean"], PKG):
        checkpoint = get_backend("savedmodel").load(path)
    revived = checkpoint.model
    assert checkpoint.metadata["revived_from"]["gated"] == "traced"
    assert checkpoint.metadata["revived_from"]["mask_maker"] == "traced"
    np.testing.assert_allclose(revived(x).numpy(), expected, atol=1e-5)

    # a new model wired from the revived layers passes the same mask along
    maker, gated = revived.get_layer("mask_maker"), revived.get_layer("gated")
    np.testing.assert_array_equal(maker.compute_mask(x).numpy(), np.abs(x).sum(axis=-1) > 0)
    inputs = keras.Input((5, 3))
    rewired = keras.Model(inputs, gated(maker(inputs), scale=3.0))
    np.testing.assert_allclose(rewired(x).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("saved_trainable", [True, False], ids=["frozen_after", "unfrozen_after"])
def test_a_revived_block_refuses_to_train_with_other_flags_than_traced(tmp_path, saved_trainable):
    """Freezing (or unfreezing) a revived block holding BatchNormalization after the load
    changed nothing in its training trace: it kept using batch statistics and updating
    them (or the other way round), silently. Such a training call is refused."""
    x, y = _data()
    model = _block_functional()
    model.get_layer("block").trainable = saved_trainable
    path = _saved(model, tmp_path, x, y)
    with classes_hidden(["NormBlock"], PKG):
        revived = get_backend("savedmodel").load(path).model
    block = revived.get_layer("block")
    block.trainable = not saved_trainable
    revived.compile(keras.optimizers.SGD(0.05), "mse")
    message = rf"'block'.*batch_normalization.*trainable={saved_trainable}.*Received: "
    with pytest.raises(RevivedCallError, match=message):
        revived.fit(x, y, epochs=1, batch_size=8, verbose=0)
    np.testing.assert_allclose(revived.predict(x, verbose=0), model.predict(x, verbose=0), 1e-5)
    block.trainable = saved_trainable  # back as traced: trains
    revived.compile(keras.optimizers.SGD(0.05), "mse")
    revived.fit(x, y, epochs=1, batch_size=8, verbose=0)
