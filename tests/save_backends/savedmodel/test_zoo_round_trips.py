"""Every zoo model round-trips through the SavedModel backend, with its custom classes
available (rebuilt from config: bitwise) and hidden (revived from traced functions)."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import savedmodel_zoo as zoo
from trainer.save_backends import get_backend
from trainer.state import TrainingState


def _flat(outputs):
    return [np.asarray(o) for o in keras.tree.flatten(outputs)]


def _predict(model, x):
    return _flat(model.predict(x, verbose=0, batch_size=32))


def _loss_value(model, x, y):
    return model.evaluate(x, y, verbose=0, batch_size=16, return_dict=True)


def _training_loss(model, x, y, state) -> float:
    for variable, value in zip(model.non_trainable_variables, state, strict=True):
        variable.assign(value)
    return float(model.compute_loss(x=x, y=y, y_pred=model(x, training=True)))


SLOW = {"wrappers", "conv_bn_dropout"}  # RNN / conv graphs: several seconds per trace


@dataclasses.dataclass
class Saved:
    """What the class-missing test compares with, taken right after the save: the exact
    test trains the original model, and either test may run first."""

    predictions: list[np.ndarray]
    n_losses: int
    optimizer_values: list[np.ndarray]


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(zoo.ZOO)],
)
def case(request, tmp_path_factory):
    """Each zoo model saved once for both tests (a save traces every function: seconds)."""
    keras.utils.set_random_seed(1)
    model, x, y, hidden = zoo.ZOO[request.param]()
    path = get_backend("savedmodel").save(
        model,
        tmp_path_factory.mktemp(request.param) / "ckpt",
        state=TrainingState(epoch=1, global_step=2),
    )
    predictions = _predict(model, x)
    model(x, training=False)
    saved = Saved(
        predictions, len(model.losses), [np.array(v.numpy()) for v in model.optimizer.variables]
    )
    return request.param, model, x, y, hidden, path, saved


def test_classes_known_round_trip_is_exact(case):
    name, model, x, y, _hidden, path, _saved = case
    checkpoint = get_backend("savedmodel").load(path)
    revived = checkpoint.model
    assert checkpoint.state.global_step == 2
    how = checkpoint.metadata["revived_from"]
    if name == "lambda_layer":  # safe mode: Lambda code is never unmarshalled
        assert how.pop("affine") == "traced"
    assert set(how.values()) <= {"config", "graph"}
    assert [type(a).__name__ for a in model._flatten_layers()] == [
        type(b).__name__ for b in revived._flatten_layers()
    ]
    for before, after in zip(_predict(model, x), _predict(revived, x), strict=True):
        np.testing.assert_array_equal(before, after)
    assert len(model.optimizer.variables) == len(revived.optimizer.variables)
    for a, b in zip(model.optimizer.variables, revived.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert _loss_value(model, x, y) == _loss_value(revived, x, y)
    for m in (model, revived):
        m.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    for a, b in zip(model.variables, revived.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{name}: {a.path}")


def _revived_layers(model, hidden):
    return [layer for layer in model._flatten_layers() if type(layer).__name__ in hidden]


def test_classes_missing_revive_from_traced_functions(case, tmp_path):
    name, _model, x, y, hidden, path, saved = case
    expected, n_losses = saved.predictions, saved.n_losses
    with zoo.classes_hidden(hidden):
        checkpoint = get_backend("savedmodel").load(path)
        revived = checkpoint.model
        if name == "custom_metric":  # a metric's state cannot be traced: dropped, reported
            assert "peak_accuracy" in str(checkpoint.metadata["dropped_metrics"])
            hidden = []
        stand_ins = _revived_layers(revived, hidden)
        # every hidden class is back under its own name, as a revived stand-in
        assert {type(layer).__name__ for layer in stand_ins} == set(hidden)
        assert all(type(layer).__module__.startswith("trainer.") for layer in stand_ins)
        for before, after in zip(expected, _predict(revived, x), strict=True):
            np.testing.assert_allclose(before, after, atol=1e-5)
        revived(x, training=False)
        assert len(revived.losses) == n_losses
        for a, b in zip(saved.optimizer_values, revived.optimizer.variables, strict=True):
            np.testing.assert_array_equal(a, b.numpy(), err_msg=b.path)

        # gradients reach every trainable variable
        with tf.GradientTape() as tape:
            out = revived(x, training=True)
            loss = sum(tf.reduce_sum(o) for o in keras.tree.flatten(out))
            loss += sum(revived.losses) if revived.losses else 0.0
        grads = tape.gradient(loss, revived.trainable_variables)
        missing = [
            v.path for v, g in zip(revived.trainable_variables, grads, strict=True) if g is None
        ]
        assert not missing, missing

        # The loss the steps minimise (training mode), from the same non-trainable state
        # both times (BatchNormalization statistics, Dropout seeds), so only the weight
        # updates differ. In inference mode, conv_bn_dropout's barely moved statistics
        # made it a coin toss (it passed by 0.02 %; 7 of 30 fixture seeds failed); so
        # measured, the loss fell by 3.8-9.7 % on all 30.
        state = [np.array(v.numpy()) for v in revived.non_trainable_variables]
        before = _training_loss(revived, x, y, state)
        revived.optimizer.learning_rate.assign(1e-3)  # a small, stable step for the check
        revived.fit(x, y, epochs=5, batch_size=16, verbose=0, shuffle=False)
        assert _training_loss(revived, x, y, state) < before

        # saved again and revived again, still without the classes
        again = get_backend("savedmodel").save(revived, tmp_path / "again")
        twice = get_backend("savedmodel").load(again).model
        for a, b in zip(_predict(revived, x), _predict(twice, x), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # and with the classes back, the re-saved checkpoint rebuilds them from config
    back = get_backend("savedmodel").load(again).model
    still_traced = {
        type(layer).__name__
        for layer in back._flatten_layers()
        if type(layer).__module__.startswith("trainer.")
    }
    assert still_traced <= {"Lambda"}  # safe mode never unmarshals the lambda's code
    for a, b in zip(_predict(revived, x), _predict(back, x), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
