"""Legacy tf.keras imports of what a model holds besides its layers' weights: optimizer
averages and slots, RNN states, frozen layers, learning-rate schedules, mixed precision,
adapted preprocessing state, metric names. Each is carried over so that the imported model
computes and trains as tf_keras did, or refused with an ``UnsupportedLegacyError``.

The models are written by ``tests/children/legacy_state_fixtures.py`` with tf_keras in ONE
subprocess per session, the one that also writes the import zoo (tf_keras and Keras 3 never
share a process).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.paths import CHILDREN_DIR
from trainer.save_backends import load_checkpoint

FIXTURES = CHILDREN_DIR / "legacy_state_fixtures.py"


@pytest.fixture(scope="session")
def made(legacy_written) -> Path:
    """Written once per test run by ``FIXTURES`` in the legacy writers' tf_keras process
    (``conftest.legacy_written``)."""
    return legacy_written / "state"


def _npy(folder: Path, name: str) -> np.ndarray:
    return np.load(folder / f"{name}.npy")


def test_ema_averages_restored_with_the_iterations(made):
    """Adam(use_ema=True): the averages come back with the slots and the iteration count;
    restored without them, Keras 3 averaged from zeros and the end of ``fit`` overwrote
    the weights with 0.9 * 0 + 0.1 * w."""
    folder = made / "ema"
    checkpoint = load_checkpoint(folder / "model")
    model, x, y = checkpoint.model, _npy(folder, "x"), _npy(folder, "y")
    assert checkpoint.metadata["optimizer_state"] == "restored"
    assert int(model.optimizer.iterations.numpy()) == 1
    np.testing.assert_array_equal(np.asarray(model(x)), _npy(folder, "pred"))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(np.asarray(model(x)), _npy(folder, "cont_pred"), atol=1e-6)


def test_stateful_rnn_states_restored(made):
    """A stateful LSTM and a Bidirectional stateful GRU continue from the states they were
    saved with (they started from zeros: the next prediction was another one)."""
    folder = made / "stateful"
    model, x = load_checkpoint(folder / "model").model, _npy(folder, "x")
    np.testing.assert_array_equal(np.asarray(model(x)), _npy(folder, "pred"))


def test_frozen_layers_import_frozen(made):
    """A frozen layer and a frozen nested base model (transfer learning) import with their
    flags, compute what tf_keras computed, and train only the head, as tf_keras did (they
    were refused as "layouts differ": the legacy trainable list of a frozen layer is empty)."""
    folder = made / "frozen"
    model, x, y = load_checkpoint(folder / "model").model, _npy(folder, "x"), _npy(folder, "y")
    frozen = {layer.name: layer.trainable for layer in model.layers if layer.weights}
    assert frozen == {"base": False, "frozen_d": False, "head": True}
    assert [v.path for v in model.trainable_variables] == ["head/kernel", "head/bias"]
    np.testing.assert_array_equal(np.asarray(model(x)), _npy(folder, "pred"))
    before = [np.array(v) for v in model.non_trainable_variables]
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    np.testing.assert_allclose(np.asarray(model(x)), _npy(folder, "cont_pred"), atol=1e-6)
    for old, variable in zip(before, model.non_trainable_variables, strict=True):
        np.testing.assert_array_equal(old, variable.numpy())


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop"])
def test_legacy_optimizer_slots_restored(made, name):
    """tf.keras.optimizers.legacy.* keep their slots in the checkpoint graph's
    ``slot_variables``: restored with the iteration count, training goes on as in tf_keras
    (they were reported "none saved" and the optimizer started fresh)."""
    _continues_as_tf_keras(made / "legacy_optimizers", name)


@pytest.mark.parametrize(
    "name",
    ["exponential", "piecewise", "polynomial", "inverse_time", "cosine", "cosine_restarts"],
)
def test_learning_rate_schedules_carried_over(made, name):
    """A Keras 2 schedule in the optimizer config becomes Keras 3's class of the same name
    and config: the same rate at every step, and training goes on as in tf_keras (the
    import failed with Keras' deserialization dump)."""
    folder = made / "schedules"
    model, x, y = load_checkpoint(folder / name).model, _npy(folder, "x"), _npy(folder, "y")
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == 2
    rates = []
    for step in range(30):
        optimizer.iterations.assign(step)
        rates.append(float(optimizer.learning_rate))
    np.testing.assert_allclose(rates, _npy(folder, f"{name}_rates"), rtol=1e-6)
    optimizer.iterations.assign(2)
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, _npy(folder, f"{name}_losses"), rtol=1e-5)


def test_unknown_learning_rate_schedule_is_refused_briefly(tmp_path, made):
    """A schedule class Keras 3 does not have (a custom one; same length as the name it
    replaces in the protobuf): a short error naming it."""
    from trainer.errors import UnsupportedLegacyError

    copy = tmp_path / "model"
    shutil.copytree(made / "schedules" / "exponential", copy)
    metadata = copy / "keras_metadata.pb"
    metadata.write_bytes(
        metadata.read_bytes().replace(b'"ExponentialDecay"', b'"MyOwnDecayRate16"')
    )
    with pytest.raises(UnsupportedLegacyError, match="MyOwnDecayRate16") as raised:
        load_checkpoint(copy)
    assert len(str(raised.value)) < 600
    assert str(raised.value).rstrip().endswith("'MyOwnDecayRate16'")


def test_mixed_precision_loss_scale_optimizer(made):
    """tf_keras' LossScaleOptimizerV3 becomes Keras 3's LossScaleOptimizer around the
    translated Adam, with the slots, iteration count and dynamic loss scale it was saved
    with (the import failed with Keras' deserialization dump)."""
    import keras

    folder = made / "mixed"
    checkpoint = load_checkpoint(folder / "model")
    model, x, y = checkpoint.model, _npy(folder, "x"), _npy(folder, "y")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert optimizer.dynamic_growth_steps == 3
    assert checkpoint.metadata["optimizer_state"] == "restored"
    assert int(optimizer.iterations.numpy()) == 2
    scale, good_steps = _npy(folder, "scale")
    assert (float(optimizer.dynamic_scale.numpy()), int(optimizer.step_counter.numpy())) == (
        scale,
        good_steps,
    )
    np.testing.assert_array_equal(np.asarray(model(x)), _npy(folder, "pred"))
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, _npy(folder, "cont_losses"), rtol=1e-3)
    assert float(optimizer.dynamic_scale.numpy()) == float(_npy(folder, "cont_scale"))


def test_adapted_normalization_keeps_its_statistics(made):
    """An adapted Normalization imports with the mean and variance adapt() gave it (it was
    refused as "layouts differ": the saved attributes list each variable twice, as
    ``mean`` and ``adapt_mean``)."""
    folder = made / "normalization"
    model, x = load_checkpoint(folder / "model").model, _npy(folder, "x")
    np.testing.assert_allclose(np.asarray(model(x)), _npy(folder, "pred"), rtol=1e-6)
    norm = model.get_layer("norm")
    np.testing.assert_allclose(np.ravel(norm.mean), x.mean(axis=0), rtol=1e-5)


@pytest.mark.parametrize("name", ["two", "one"])
def test_metric_names_are_tf_keras(made, name):
    """The imported model logs its metrics under tf_keras' names (what callbacks monitor):
    ``cls_accuracy``, ``reg_mae``, ``reg_root_mean_squared_error``, not
    ``cls_sparse_categorical_accuracy``, ``reg_mean_absolute_error`` or the prefix twice."""
    folder = made / "metric_names"
    model = load_checkpoint(folder / name).model
    x, y = _npy(folder, "x"), {"cls": _npy(folder, "y_cls"), "reg": _npy(folder, "y_reg")}
    logs = model.evaluate(x, y if name == "two" else y["reg"], verbose=0, return_dict=True)
    assert sorted(logs) == json.loads((folder / f"{name}_keys.json").read_text())


@pytest.mark.parametrize("name", ["sgd", "legacy_sgd"])
def test_iterations_of_an_optimizer_without_slots_restored(made, name):
    """An optimizer with no slots to restore (SGD without momentum) still gets its
    iteration count back, which its learning-rate schedule reads (it restarted at 0, so the
    rate went back up: "none saved")."""
    _continues_as_tf_keras(made / "slotless", name)


def _continues_as_tf_keras(folder: Path, name: str) -> None:
    """The import of ``folder/name`` restored its optimizer (two steps trained) and its
    next three steps lose what tf_keras' did."""
    checkpoint = load_checkpoint(folder / name)
    model, x, y = checkpoint.model, _npy(folder, "x"), _npy(folder, "y")
    assert checkpoint.metadata["optimizer_state"] == "restored"
    assert int(model.optimizer.iterations.numpy()) == 2
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, _npy(folder, f"{name}_losses"), rtol=1e-5)


def test_stateful_rnn_states_that_do_not_fit_are_refused(made, tmp_path):
    """States the Keras 3 layer cannot hold (here: the batch size edited from 4 to 6, so
    Keras 3 builds (6, 2) states for the saved (4, 2)) are an error naming the layer, never
    states started from zeros."""
    from trainer.errors import UnsupportedLegacyError

    copy = tmp_path / "model"
    shutil.copytree(made / "stateful" / "model", copy)
    metadata = copy / "keras_metadata.pb"
    metadata.write_bytes(metadata.read_bytes().replace(b"[4, 5, 3]", b"[6, 5, 3]"))
    with pytest.raises(UnsupportedLegacyError, match=r"'lstm'.*stateful") as raised:
        load_checkpoint(copy)
    assert "Received: saved [(4, 2), (4, 2)]" in str(raised.value)
