"""The background save writes what a synchronous save would (issue 14, defects 9 and 10):
the shadow copy carries adapted preprocessing state, and a subclassed model's shadow can be
traced."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer import train
from trainer.checkpointing import clone_for_snapshot, refresh_snapshot
from trainer.save_backends import get_backend, load_checkpoint


def adapted_model() -> keras.Model:
    rng = np.random.default_rng(1)
    numbers = rng.normal(20.0, 4.0, size=(64, 2)).astype("float32")
    ids = rng.integers(3, 9, size=(64, 1)).astype("int64")
    normalization, lookup = keras.layers.Normalization(), keras.layers.IntegerLookup()
    normalization.adapt(numbers)
    lookup.adapt(ids)
    x_in, id_in = keras.Input((2,)), keras.Input((1,), dtype="int64")
    ids_out = keras.ops.cast(lookup(id_in), "float32")
    model = keras.Model([x_in, id_in], keras.layers.Concatenate()([normalization(x_in), ids_out]))
    model.compile(optimizer="adam", loss="mse")
    return model, [numbers[:8], ids[:8]]


@pytest.mark.parametrize("backend", ["h5", "weights", "savedmodel"])
def test_shadow_copy_carries_adapted_state(backend, tmp_path):
    model, probe = adapted_model()
    expected = model.predict(probe, verbose=0)
    shadow = clone_for_snapshot(model)
    refresh_snapshot(model, shadow)
    np.testing.assert_allclose(shadow.predict(probe, verbose=0), expected, atol=1e-5)
    path = get_backend(backend).save(shadow, tmp_path / "ckpt")
    loaded = load_checkpoint(path).model
    np.testing.assert_allclose(loaded.predict(probe, verbose=0), expected, atol=1e-5)


def test_documented_subclassed_config_trains_with_the_default_async_backend(compose_cfg):
    """``python train.py model=subclassed`` with the default (async) savedmodel backend."""
    cfg = compose_cfg("model=subclassed")
    assert cfg.save._target_.endswith("SavedModelBackend")
    train(cfg)
    latest = load_checkpoint(f"{cfg.run_dir}/checkpoints/latest")
    assert latest.metadata["backend"] == "savedmodel" and latest.state.epoch == 2


@pytest.mark.parametrize("backend", ["h5", "savedmodel"])
def test_async_saves_carry_state_adapted_again_between_them(backend, tmp_path):
    """The async backend finds the layers with their own state once, with its traced copy,
    and reuses that list save after save: each save must still copy their state as it is
    then. Re-adapting the lookup changes its table, not its variables."""
    from trainer.checkpointing import AsyncBackend

    model, probe = adapted_model()
    lookup = next(x for x in model.layers if isinstance(x, keras.layers.IntegerLookup))
    saver = AsyncBackend(get_backend(backend))
    saver.prepare(model)  # traces the copy and finds the stateful layers, in the background
    saver.wait()
    first = saver.save(model, tmp_path / "first")
    saver.wait()
    lookup.adapt(np.arange(100, 106, dtype="int64").reshape(-1, 1))
    probe = [probe[0], np.arange(100, 108, dtype="int64").reshape(-1, 1)]
    expected = model.predict(probe, verbose=0)
    second = saver.save(model, tmp_path / "second")
    saver.wait()
    loaded = load_checkpoint(second).model
    np.testing.assert_allclose(loaded.predict(probe, verbose=0), expected, atol=1e-5)
    older = load_checkpoint(first).model.predict(probe, verbose=0)
    assert not np.allclose(older, expected)  # the probe does tell the two tables apart


def _trained_with_a_base_layer(seed: int) -> tuple[keras.Model, np.ndarray]:
    """Dense "base" and a head, compiled with Adam and trained one epoch (slots built)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="base"), keras.layers.Dense(1)]
    )
    x = np.random.default_rng(seed).normal(size=(16, 4)).astype("float32")
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    return model, x


@pytest.mark.parametrize("backend", ["h5", "savedmodel"])
def test_async_save_after_freezing_a_layer_saves_it_frozen(backend, tmp_path):
    """The shadow follows the live model's ``trainable`` flags save by save, and its
    optimizer is built for the live optimizer's variables: a layer frozen after the first
    async save (fine-tuning) is saved frozen, with the optimizer as it is, like a sync save."""
    from trainer.checkpointing import AsyncBackend
    from trainer.model_state import trainable

    model, x = _trained_with_a_base_layer(seed=3)
    saver = AsyncBackend(get_backend(backend))
    saver.save(model, tmp_path / "before")
    model.get_layer("base").trainable = False
    model.compile(optimizer=model.optimizer, loss="mse")
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    after = saver.save(model, tmp_path / "after")
    saver.wait()
    loaded = load_checkpoint(after).model
    assert not loaded.get_layer("base").trainable
    assert len(loaded.trainable_variables) == 2
    assert trainable.optimizer_built_for(loaded) == trainable.optimizer_built_for(model)
    for mine, theirs in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_async_save_keeps_weight_decay_exclusions(tmp_path):
    """The shadow is rebuilt from the model's config, which does not hold the variables left
    out of weight decay: its optimizer gets them from the live one, so the async checkpoint
    trains on like the model."""
    from trainer.checkpointing import AsyncBackend

    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(4).normal(size=(16, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, shuffle=False, verbose=0)
    saver = AsyncBackend(get_backend("savedmodel"))
    path = saver.save(model, tmp_path / "ckpt")
    saver.wait()
    loaded = load_checkpoint(path).model
    for each in (model, loaded):
        each.fit(x, x[:, :1], batch_size=8, shuffle=False, verbose=0)
    for mine, theirs in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.parametrize("backend", ["weights", "savedmodel"])
def test_async_saving_that_starts_after_a_layer_was_frozen(backend, tmp_path):
    """The shadow is first built after the freeze: Keras compiles it from the config and
    builds its optimizer for the trainable variables, fewer than the live optimizer's.
    It is compiled again the way a load is, so the save works and keeps the slots."""
    from trainer.checkpointing import AsyncBackend
    from trainer.model_state import trainable

    model, _ = _trained_with_a_base_layer(seed=8)
    model.get_layer("base").trainable = False
    model.compile(optimizer=model.optimizer, loss="mse")
    saver = AsyncBackend(get_backend(backend))
    path = saver.save(model, tmp_path / "ckpt")
    saver.wait()
    loaded = load_checkpoint(path).model
    assert trainable.optimizer_built_for(loaded) == trainable.optimizer_built_for(model)
    for mine, theirs in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_the_shadows_structure_fingerprint_follows_flags_and_variables():
    """The shadow is a private copy (``kit.mark_private_copy``): the savedmodel
    backend checks its structure by flags and variable identities alone, and must still
    see every change trainer can make to it, giving the very fingerprint a full check
    would."""
    from trainer.model_state import kit
    from trainer.save_backends.savedmodel.save import structure

    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))
    model.compile(optimizer="adam", loss="mse")
    shadow = clone_for_snapshot(model)
    assert kit.is_private_copy(shadow) and not kit.is_private_copy(model)

    def check():
        value = structure.fingerprint(shadow)
        assert value == structure._fingerprint(shadow)
        return value

    first = check()
    assert check() == first  # remembered, unchanged
    model.get_layer("hidden").trainable = False
    refresh_snapshot(model, shadow)  # carries the flag
    frozen = check()
    assert frozen != first
    shadow.compile(optimizer="sgd", loss="mse")  # another optimizer, not built yet
    unbuilt = check()
    assert unbuilt != frozen
    shadow.optimizer.build(shadow.trainable_variables)  # its variables appear
    assert check() != unbuilt


class DoublingUnregistered(keras.layers.Layer):  # deliberately not registered
    def call(self, x):
        return 2.0 * x


class Factor:  # a plain Python object: Keras cannot put it in a config
    def __init__(self, value):
        self.value = value


class NeedsFactor(keras.layers.Layer):  # so it has no config to be rebuilt from
    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor.value


def _model_around(middle: keras.layers.Layer) -> keras.Model:
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(middle(inputs)))
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3)), np.zeros((8, 2)), verbose=0)
    return model


@pytest.mark.parametrize(
    "middle",
    [lambda: keras.layers.Lambda(lambda t: 2.0 * t), DoublingUnregistered],
    ids=["lambda", "unregistered"],
)
def test_async_copy_of_a_model_with_a_lambda_or_an_unregistered_class(middle, tmp_path):
    """The shadow was rebuilt in safe mode from registered classes only, so the default
    (async) savedmodel checkpointing of these models, which it saves synchronously,
    crashed fit with a raw Keras error. The copy is the live model's own config."""
    from trainer.checkpointing import CheckpointManager, CheckpointPolicy

    model = _model_around(middle())
    probe = np.random.default_rng(0).normal(size=(4, 3))
    policy = CheckpointPolicy(async_save=True)
    with CheckpointManager(tmp_path / "ckpt", backend="savedmodel", policy=policy) as manager:
        manager.save(model)
        assert manager.backend._shadow is not None  # written from the copy
        manager.wait()
        path = manager.latest()
    loaded = load_checkpoint(path).model
    np.testing.assert_array_equal(loaded.predict(probe, verbose=0), model.predict(probe, verbose=0))


def test_a_model_that_cannot_be_copied_is_saved_synchronously_with_a_warning(tmp_path, caplog):
    """No copy possible: every save writes the model itself (what a sync save writes), and
    one warning says why, instead of a raw error from Keras ending fit."""
    from trainer.checkpointing import CheckpointManager, CheckpointPolicy

    model = _model_around(NeedsFactor(Factor(3.0)))
    probe = np.random.default_rng(0).normal(size=(4, 3))
    policy = CheckpointPolicy(async_save=True, keep_last=5)
    with CheckpointManager(tmp_path / "ckpt", backend="savedmodel", policy=policy) as manager:
        for _ in range(2):
            model.fit(np.ones((8, 3)), np.ones((8, 2)), verbose=0)
            expected = model.predict(probe, verbose=0)
            path = manager.save(model)  # returns once written: no copy to write later
            loaded = load_checkpoint(path).model
            np.testing.assert_array_equal(loaded.predict(probe, verbose=0), expected)
    warnings = [r for r in caplog.records if "written synchronously" in r.getMessage()]
    assert len(warnings) == 1 and "NeedsFactor" in warnings[0].getMessage()
