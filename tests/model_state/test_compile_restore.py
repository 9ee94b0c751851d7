"""Compiling a revived SavedModel as saved (issue 14, defect 22): a metric whose class is
missing at load is dropped and reported, as documented, not called damage; every other
metric is kept (all of them were dropped with it, built-in ones and weighted ones too)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer._compat.keras_training import wrapped_function_arguments
from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.errors import MissingClassError
from trainer.save_backends import get_backend, load_checkpoint

PACKAGE = "test_compile_restore"


@keras.saving.register_keras_serializable(package=PACKAGE)
class MeanPrediction(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(keras.ops.mean(y_pred))


def test_metric_with_missing_class_is_dropped_and_reported(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(
        optimizer="adam",
        loss="mse",
        metrics=["mae", MeanPrediction(name="mine")],
        weighted_metrics=["mse"],
    )
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = get_backend("savedmodel").save(model, tmp_path / "ckpt")
    with classes_hidden(["MeanPrediction"], PACKAGE):
        checkpoint = load_checkpoint(path)
    (dropped,) = checkpoint.metadata["dropped_metrics"]
    assert dropped["registered_name"] == f"{PACKAGE}>MeanPrediction"
    assert checkpoint.model.compiled
    assert int(checkpoint.model.optimizer.iterations.numpy()) == 1  # optimizer state kept
    x, y = np.ones((4, 3)), np.zeros((4, 2))
    want = model.evaluate(x, y, verbose=0, return_dict=True)
    got = checkpoint.model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(got) == set(want) - {"mine"} and len(got) == 3  # loss, mae, weighted mse
    assert all(got[name] == want[name] for name in got)


@keras.saving.register_keras_serializable(package=PACKAGE)
def doubled_mse(y_true, y_pred):
    return 2.0 * keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_missing_loss_function_is_named_as_a_function(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss=doubled_mse)
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
    path = get_backend("h5").save(model, tmp_path / "ckpt")
    expected = r"custom_objects=\{'[^']*doubled_mse': the_f"
    with classes_hidden(["doubled_mse"], PACKAGE), pytest.raises(MissingClassError, match=expected):
        load_checkpoint(path)


@keras.saving.register_keras_serializable(package=PACKAGE)
class TupleOfDicts(keras.Model):
    """Outputs a tuple of dicts: its loss, a tuple too, must stay one (JSON has lists)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(3)
        self.second = keras.layers.Dense(2)

    def call(self, x):
        a = self.first(x)
        return ({"z": a, "b": self.second(x)}, {"only": 2.0 * a})


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_tuple_structured_loss_and_metrics_train_after_a_load(tmp_path, backend):
    """The loss and metrics given as tuples came back as lists: the load succeeded and the
    first training step raised a raw KeyError (the path () is not in y_pred). Saved in the
    foreground and in the background (the shadow the background write saves is compiled
    from the same record), both from one model: each load trains and predicts as it does."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = (
        {"z": rng.normal(size=(8, 3)), "b": rng.normal(size=(8, 2))},
        {"only": rng.normal(size=(8, 3))},
    )
    model = TupleOfDicts()
    model(x)
    model.compile(
        optimizer="adam",
        loss=({"z": "mse", "b": "mse"}, {"only": "mae"}),
        metrics=({"z": ["mae"], "b": None}, {"only": ("mse",)}),
    )
    model.train_on_batch(x, y)
    loaded = {}
    for background in ("sync", "async"):
        policy = CheckpointPolicy(async_save=background == "async")
        with CheckpointManager(tmp_path / background, backend=backend, policy=policy) as manager:
            manager.save(model)
            manager.wait()
            path = manager.latest()
        loaded[background] = load_checkpoint(path).model
        loaded[background](x)
    want = model.train_on_batch(x, y, return_dict=True)
    predicted = model.predict(x, verbose=0)[1]["only"]
    for background, each in loaded.items():
        assert each.train_on_batch(x, y, return_dict=True) == want, background
        np.testing.assert_array_equal(each.predict(x, verbose=0)[1]["only"], predicted)


class _TightHuber(keras.losses.Huber):
    """Its function takes ``delta``; its constructor does not, and its config says nothing."""

    def __init__(self, tight=False, name="tight_huber", reduction="sum_over_batch_size"):
        super().__init__(delta=0.1 if tight else 1.0, name=name, reduction=reduction)


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_loss_and_metric_arguments_their_configs_leave_out_are_kept(tmp_path, backend):
    """Keras 3.15's Huber.get_config leaves out delta, CosineSimilarity's and
    SparseTopKCategoricalAccuracy's leave out axis and from_sorted_ids: a Huber(delta=0.3)
    came back as delta=1.0, and the loaded model evaluated and trained on another loss."""
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4)(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(2, name="a")(hidden),
                                 "b": keras.layers.Dense(2, name="b")(hidden)})  # fmt: skip
    model.compile(
        optimizer="sgd",
        loss={"a": keras.losses.Huber(delta=0.3), "b": keras.losses.CosineSimilarity(axis=0)},
        metrics={"a": [keras.metrics.CosineSimilarity(axis=0)]},
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), {"a": rng.normal(size=(8, 2)), "b": rng.normal(size=(8, 2))}
    model.fit(x, y, verbose=0)
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    loaded = load_checkpoint(path).model
    want = model.evaluate(x, y, verbose=0, return_dict=True)
    got = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert wrapped_function_arguments(loaded.loss["a"])["delta"] == 0.3
    model.fit(x, y, verbose=0)
    loaded.fit(x, y, verbose=0)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_a_loss_argument_no_config_can_hold_is_refused_at_save(tmp_path):
    from trainer.errors import ModelNotReadyError

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss=_TightHuber(tight=True))
    with pytest.raises(
        ModelNotReadyError, match=r"computes with \['delta'\].*Received: \{'delta': 0\.1\}"
    ):
        get_backend("weights").save(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
