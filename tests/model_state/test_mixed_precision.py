"""A model trained under ``mixed_float16`` (set globally, as Keras documents) loads in a
process whose global policy is the default ``float32``: every backend rebuilds it with its
own policy and its ``LossScaleOptimizer``, whose loss-scale state it restores, so that it
predicts and trains on exactly as the saved one."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.save_backends import get_backend


@pytest.fixture
def mixed_model():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(5)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(hidden))
        model.compile(optimizer="adam", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 6)).astype("float32")
        y = rng.normal(size=(32, 2)).astype("float32")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        yield model, x, y
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_a_mixed_precision_model_loads_and_trains_on_under_the_default_policy(
    backend, mixed_model, tmp_path
):
    model, x, y = mixed_model
    path = get_backend(backend).save(model, tmp_path / "ckpt")
    keras.mixed_precision.set_dtype_policy("float32")  # a new process's global policy
    loaded = get_backend(backend).load(path).model
    assert keras.config.dtype_policy().name == "float32"  # put back after the load
    assert loaded.dtype_policy.name == "mixed_float16"
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
    for mine, theirs in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs), err_msg=mine.path)
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    keras.mixed_precision.set_dtype_policy("mixed_float16")  # both go on as trained
    try:
        keras.utils.set_random_seed(9)
        before = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        keras.utils.set_random_seed(9)
        after = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert before.history["loss"] == after.history["loss"]
    for mine, theirs in zip(model.variables, loaded.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs), err_msg=mine.path)


def test_an_async_copy_keeps_the_loss_scale_optimizer_when_the_global_policy_changed(
    mixed_model, tmp_path
):
    """The async shadow is rebuilt from the model's config: under the model's own policy,
    even if the global one was set back to float32 after the model was built."""
    from trainer.checkpointing import AsyncBackend, CheckpointManager, CheckpointPolicy
    from trainer.checkpointing.shadow import all_variables

    model, x, y = mixed_model
    keras.mixed_precision.set_dtype_policy("float32")
    manager = CheckpointManager(
        tmp_path / "ckpt", AsyncBackend(get_backend("savedmodel")), CheckpointPolicy()
    )
    before = [np.array(v) for v in all_variables(model)]
    path = manager.save(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    manager.close()
    loaded = get_backend("savedmodel").load(path).model
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
    for value, variable in zip(before, all_variables(loaded), strict=True):
        np.testing.assert_array_equal(value, np.asarray(variable), err_msg=variable.path)


def test_a_stored_policy_is_read_only_if_it_is_a_keras_policy():
    """The record is untrusted: anything but a known policy means 'the current global one',
    and no other class reaches Keras' deserializer."""
    from trainer.model_state import dtype_policy

    mixed = keras.dtype_policies.serialize(keras.DTypePolicy("mixed_bfloat16"))
    assert dtype_policy.stored_policy(mixed).name == "mixed_bfloat16"
    assert dtype_policy.stored_policy("mixed_float16").name == "mixed_float16"
    dense = {"module": "keras.layers", "class_name": "Dense", "config": {"units": 2}}
    unknown = {"class_name": "DTypePolicy", "config": {"name": "nonsense"}}
    for record in (None, "nonsense", 5, dense, unknown):
        assert dtype_policy.stored_policy(record) is None


def _binning_model(**discretization_kwargs) -> keras.Model:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        inputs = keras.Input((3,))
        bins = keras.layers.Discretization(bin_boundaries=[0.0, 1.0], **discretization_kwargs)
        outputs = keras.layers.Dense(1, dtype="float32")(keras.ops.cast(bins(inputs), "float32"))
        return keras.Model(inputs, outputs)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("backend", ["savedmodel", "h5", "weights"])
def test_a_layer_whose_config_loses_its_policy_is_refused(tmp_path, backend):
    """Discretization's config records "float32" while it bins bf16-rounded inputs under
    mixed_bfloat16 (0.999 falls in the last bin): every load rebuilt it under float32 and
    predicted otherwise, silently. Refused; with an explicit dtype it saves and loads."""
    from trainer.errors import ModelNotReadyError
    from trainer.save_backends import load_checkpoint

    with pytest.raises(ModelNotReadyError, match="records dtype 'float32'"):
        get_backend(backend).save(_binning_model(), tmp_path / "refused")
    model = _binning_model(dtype="float32")
    x = np.array([[0.999, 1.001, -0.0001]], dtype="float32")
    loaded = load_checkpoint(get_backend(backend).save(model, tmp_path / "ckpt")).model
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
