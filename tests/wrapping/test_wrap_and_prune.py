"""wrap_model / unwrap_model on every kind of model, and magnitude pruning end to end.

Models are built here (tiny, random data) so the tests do not depend on the model zoo; the
zoo's resnet gets its own test at the end.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import pytest
import tensorflow as tf
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers.paths import CONF_DIR
from trainer import wrapping
from trainer.errors import ConfigMismatchError, TrainerError
from trainer.model_state import kit
from trainer.wrapping import WrapHost, find_layers, unwrap_model, wrap_model
from trainer.wrapping.pruning import (
    PolynomialSparsity,
    PruneLowMagnitude,
    PruningCallback,
    prunable,
    sparsity_report,
)

# Test blocks build lazily on first call, as many user layers do; Keras warns on reload.
pytestmark = pytest.mark.filterwarnings("ignore:`build\\(\\)` was called on layer")
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


def sequential_with_block():
    return keras.Sequential(
        [keras.Input((8, 8, 2)), L.Conv2D(4, 3, padding="same"), Block(4),
         L.GlobalAveragePooling2D(), L.Dense(3)]
    )  # fmt: skip


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
    return keras.Model(inputs, L.Dense(3)(Outer(4, name="outer")(inputs)))


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
    return lambda model: [x for x in find_layers(model, L.Layer) if isinstance(x, layer_types)]


def plain_count(model):
    """Dense/Conv layers NOT inside a PruneLowMagnitude."""
    inside = {id(w.layer) for w in find_layers(model, PruneLowMagnitude)}
    return sum(id(x) not in inside for x in kernels()(model))


def same_outputs(a, b, x, atol=1e-5):
    """Inference outputs, called eagerly (tracing a predict function costs seconds)."""
    out_a, out_b = a(x, training=False), b(x, training=False)
    np.testing.assert_allclose(np.asarray(out_a), np.asarray(out_b), atol=atol)


# ------------------------------------------------------------------- structural tests
@pytest.mark.parametrize("build", [sequential, sequential_with_block, residual, deep, subclassed])
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
    plain = unwrap_model(wrapped)  # back to the caller's own classes, same weights
    assert type(plain) is type(model) and not find_layers(plain, WrapHost)
    assert [type(x).__name__ for x in find_layers(plain, L.Layer)] == [
        type(x).__name__ for x in find_layers(model, L.Layer)
    ]
    same_outputs(model, plain, x)


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
    hosts = [x for x in wrapped.layers if isinstance(x, WrapHost)]
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
    inner = [w.layer for w in find_layers(twice, PruneLowMagnitude)]
    assert not any(isinstance(layer, PruneLowMagnitude) for layer in inner)


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


# ---------------------------------------------------------------------------- pruning
def test_polynomial_schedule_reaches_target_at_end_and_updates_on_its_grid():
    s = PolynomialSparsity(target=0.8, initial=0.2, begin=10, end=30, frequency=5, power=3)
    assert s.sparsity_at(10) == pytest.approx(0.2) and s.sparsity_at(30) == pytest.approx(0.8)
    assert s.sparsity_at(20) == pytest.approx(0.8 + (0.2 - 0.8) * 0.5**3)
    values = [s.sparsity_at(t) for t in range(10, 40)]
    assert values == sorted(values) and s.sparsity_at(99) == pytest.approx(0.8)
    assert [s.last_update(t) for t in (9, 10, 14, 15, 29, 30, 31)] == [None, 10, 10, 15, 25, 30, 30]
    with pytest.raises(ValueError, match="target_sparsity"):
        PolynomialSparsity(target=1.0)
    with pytest.raises(ValueError, match="frequency"):
        PolynomialSparsity(target=0.5, frequency=0)


def test_mask_is_in_the_forward_pass_so_outputs_and_gradients_respect_it():
    inputs = keras.Input((6,))
    model = keras.Model(inputs, L.Dense(4)(inputs))
    wrapped = prune(model)
    wrapper = find_layers(wrapped, PruneLowMagnitude)[0]
    wrapper.prune_to(0.5)
    mask = keras.ops.convert_to_numpy(wrapper.masks[0])
    assert mask.sum() == 12  # exactly half of 6 x 4
    kernel = wrapper.layer.kernel
    kernel.assign(kernel + 1.0)  # masked entries drift (momentum does that): still ignored
    x = np.random.default_rng(1).normal(size=(5, 6)).astype("float32")
    expected = x @ (keras.ops.convert_to_numpy(kernel) * mask) + wrapper.layer.bias.numpy()
    np.testing.assert_allclose(wrapped(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(wrapped(x, training=True) ** 2)
    grad = tape.gradient(loss, kernel.value)
    assert np.all(grad.numpy()[mask == 0] == 0) and np.any(grad.numpy()[mask == 1] != 0)


def fit(model, x, y, epochs, initial_epoch=0):
    model.fit(
        x, y, batch_size=8, epochs=epochs, initial_epoch=initial_epoch, shuffle=False,
        callbacks=[PruningCallback()], verbose=0,
    )  # fmt: skip


def compiled(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A residual model with a shared block, pruned to 50% over 8 of its 16 steps."""
    keras.utils.set_random_seed(3)
    model = residual(shared=True)
    wrapped = compiled(prune(model, target_sparsity=0.5, end_step=8, frequency=2))
    x, y = data(model, 32)
    fit(wrapped, x, y, epochs=4)
    return wrapped, x


def test_training_reaches_target_sparsity_in_every_wrapped_kernel(trained):
    wrapped, _ = trained
    report = sparsity_report(wrapped)
    rows = [r for r in report["layers"] if r["wrapped"]]
    assert len(rows) == 4 and not [r for r in report["layers"] if not r["wrapped"]]
    for row in rows:  # exactly round(0.5 * size) zeros, in the mask and in the stored kernel
        assert row["zeros"] == round(0.5 * row["size"]), row
        assert row["stored_sparsity"] == pytest.approx(row["sparsity"]), row
    steps = {int(w.pruning_step.numpy()) for w in find_layers(wrapped, PruneLowMagnitude)}
    assert steps == {8}


def test_unwrapped_model_matches_wrapped_and_serves_the_same_from_a_savedmodel(trained, tmp_path):
    wrapped, x = trained
    plain = unwrap_model(wrapped)
    assert not find_layers(plain, PruneLowMagnitude) and not find_layers(plain, WrapHost)
    assert find_layers(wrapped, PruneLowMagnitude)  # the training model is left as it was
    expected = wrapped.predict(x, verbose=0)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, atol=1e-5)
    assert sparsity_report(plain)["sparsity"] == pytest.approx(sparsity_report(wrapped)["sparsity"])
    plain.export(str(tmp_path / "serving"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "serving"))  # keep it: it owns the variables
    np.testing.assert_allclose(loaded.serve(tf.constant(x)).numpy(), expected, atol=1e-5)


def round_trip(model, custom_objects=None):
    """What a config-based backend does: config, weights, compile, optimizer by position."""
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    clone = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    for dst, src in zip(clone.weights, model.weights, strict=True):
        dst.assign(src)
    kit.compile_model(
        clone, kit.compile_config(model), custom_objects={}, safe_mode=True, where=Path("-")
    )
    arrays = [value for _, value in kit.optimizer_arrays(model)]
    kit.restore_optimizer_arrays(clone, arrays, "round trip")
    return clone


def assert_same_weights(a, b):
    assert len(a.weights) == len(b.weights)
    for va, vb in zip(a.weights, b.weights, strict=True):
        np.testing.assert_allclose(va.numpy(), vb.numpy(), atol=1e-6, err_msg=va.path)


BACKENDS = ("h5", "weights", "savedmodel")
WRAP_CLASSES = ("PruneLowMagnitude", "WrapHost")


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A pruned run of 2 epochs (8 steps, masks at steps 0, 3, 6, 7) snapshotted after epoch 1,
    mid-schedule: by a config round trip and by every save backend there is."""
    from trainer.save_backends import get_backend

    keras.utils.set_random_seed(5)
    model = compiled(prune(deep(), target_sparsity=0.6, end_step=7, frequency=3))
    x, y = data(model, 32, seed=2)
    fit(model, x, y, epochs=1)
    snapshots = {"round trip": round_trip(model)}
    for name in BACKENDS:
        try:
            backend = get_backend(name)
        except ImportError as error:  # a backend still being written: its tests skip
            snapshots[name] = f"save backend {name!r} cannot be imported yet: {error}"
            continue
        snapshots[name] = backend.save(model, tmp_path_factory.mktemp(name) / "ckpt")
    before = {
        "outputs": model.predict(x, verbose=0),
        "steps": [int(w.pruning_step.numpy()) for w in find_layers(model, PruneLowMagnitude)],
    }
    fit(model, x, y, epochs=2, initial_epoch=1)  # the uninterrupted run goes on
    return model, x, y, snapshots, before


def resumed(checkpointed, name, **load_options):
    from trainer.save_backends import load_checkpoint

    snapshot = checkpointed[3][name]
    if isinstance(snapshot, str):
        pytest.skip(snapshot)
    if name == "round trip":
        return snapshot
    return load_checkpoint(snapshot, **load_options).model


@pytest.mark.parametrize("name", ["round trip", *BACKENDS])
def test_resuming_a_wrapped_checkpoint_continues_the_schedule_exactly(checkpointed, name):
    reference, x, y, _, before = checkpointed
    model = resumed(checkpointed, name)
    assert len(find_layers(model, PruneLowMagnitude)) == 5 and plain_count(model) == 0
    assert (
        [int(w.pruning_step.numpy()) for w in find_layers(model, PruneLowMagnitude)]
        == [3] * 5
        == before["steps"]
    )
    np.testing.assert_allclose(model.predict(x, verbose=0), before["outputs"], atol=1e-6)
    fit(model, x, y, epochs=2, initial_epoch=1)
    assert int(model.optimizer.iterations.numpy()) == 8
    assert_same_weights(reference, model)


@pytest.mark.parametrize("name", ["h5", "weights"])
def test_config_backends_need_the_wrapper_classes_or_custom_objects(checkpointed, name):
    from trainer.errors import MissingClassError

    with classes_hidden():
        with pytest.raises(MissingClassError, match=r"not registered.*custom_objects"):
            resumed(checkpointed, name)
        model = resumed(checkpointed, name, custom_objects=wrapping.custom_objects())
    assert len(find_layers(model, PruneLowMagnitude)) == 5
    np.testing.assert_allclose(
        model.predict(checkpointed[1], verbose=0), checkpointed[4]["outputs"], atol=1e-6
    )


def test_savedmodel_revives_a_wrapped_model_without_the_wrapper_classes(checkpointed):
    x, before = checkpointed[1], checkpointed[4]
    with classes_hidden():
        model = resumed(checkpointed, "savedmodel")
        stand_ins = {type(layer).__name__ for layer in find_layers(model, L.Layer)}
        assert set(WRAP_CLASSES) <= stand_ins
        np.testing.assert_allclose(model.predict(x, verbose=0), before["outputs"], atol=1e-5)


@contextlib.contextmanager
def classes_hidden():
    """As if ``trainer.pruning`` / ``trainer.wrapping`` had never registered their classes."""
    objects = keras.saving.get_custom_objects()
    names = keras.src.saving.object_registration.GLOBAL_CUSTOM_NAMES
    saved = {f"trainer>{n}": objects.pop(f"trainer>{n}") for n in WRAP_CLASSES}
    for cls in saved.values():
        names.pop(cls)
    try:
        yield
    finally:
        for key, cls in saved.items():
            objects[key], names[cls] = cls, key


def test_wrapped_model_needs_the_wrapper_classes_or_custom_objects():
    wrapped = prune(deep())
    config = keras.saving.serialize_keras_object(wrapped)
    with classes_hidden():
        with pytest.raises(TypeError, match=r"Could not locate class '(WrapHost|PruneLowMagn)"):
            keras.saving.deserialize_keras_object(copy.deepcopy(config))  # Keras pops from it
        objects = wrapping.custom_objects()
        clone = keras.saving.deserialize_keras_object(config, custom_objects=objects)
    assert len(find_layers(clone, PruneLowMagnitude)) == 5


# ------------------------------------------------------------------------- config group
def load_yaml(name):
    """The ``wrap`` group as ``wrap=<name>`` composes it (its YAML extends a schema)."""
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose("config", overrides=[f"wrap={name}"]).wrap


def test_wrap_none_changes_nothing():
    model = residual()
    assert wrapping.apply_wrap(model, load_yaml("none")) == (model, [])
    assert wrapping.apply_wrap(model, None) == (model, [])


def test_wrap_prune_config_wraps_listed_types_and_resolves_a_null_end_step():
    cfg = load_yaml("prune")
    model = residual()
    with pytest.raises(ConfigMismatchError, match="end_step"):
        wrapping.apply_wrap(model, cfg)
    wrapped, callbacks = wrapping.apply_wrap(model, cfg, total_steps=40)
    assert [type(c) for c in callbacks] == [PruningCallback]
    wrappers = find_layers(wrapped, PruneLowMagnitude)
    assert {type(w.layer).__name__ for w in wrappers} == set(cfg.layer_types) & {"Conv2D", "Dense"}
    assert {w.schedule.end for w in wrappers} == {40}
    assert {w.schedule.target for w in wrappers} == {cfg.target_sparsity}
    again, _ = wrapping.apply_wrap(wrapped, cfg, total_steps=40)  # resumed run: no re-wrap
    assert again is wrapped
    with pytest.raises(ConfigMismatchError, match="already pruned"):
        wrapping.apply_wrap(wrapped, cfg, total_steps=50)  # would not continue the schedule
    bad = OmegaConf.merge(cfg, {"layer_types": ["Dense", "NoSuchLayer"]})
    with pytest.raises(ConfigMismatchError, match="NoSuchLayer"):
        wrapping.apply_wrap(model, bad, total_steps=40)
    with pytest.raises(TrainerError, match="Unknown wrap kind"):
        wrapping.apply_wrap(model, {"kind": "quantize"})


# ------------------------------------------------------------------------- model zoo
def test_zoo_resnet_blocks_are_wrapped_inside_and_unwrap_to_the_same_outputs():
    models = pytest.importorskip("trainer.models", reason="trainer/models.py not landed yet")
    model = models.build_resnet((8, 8, 1), 3, blocks=2, width=4)
    wrapped = prune(model, target_sparsity=0.7)
    blocks = find_layers(wrapped, models.ResidualBlock)
    assert len(blocks) == 2
    for block in blocks:
        for name in ("conv1", "conv2", "gate"):
            assert isinstance(getattr(block, name), PruneLowMagnitude), (block.name, name)
    assert plain_count(wrapped) == 0 and len(find_layers(wrapped, PruneLowMagnitude)) == 8
    for wrapper in find_layers(wrapped, PruneLowMagnitude):
        wrapper.apply_schedule(wrapper.schedule.end)  # what PruningCallback does at end_step
    report = sparsity_report(wrapped)
    assert all(r["zeros"] == round(0.7 * r["size"]) for r in report["layers"]), report
    plain = unwrap_model(wrapped)
    assert type(find_layers(plain, models.ResidualBlock)[0].conv1) is L.Conv2D
    assert sparsity_report(plain)["sparsity"] == pytest.approx(report["sparsity"])
    x, _ = data(model, 8)
    same_outputs(wrapped, plain, x)


# ------------------------------------------------------------------- training loop
@pytest.mark.slow
def test_train_with_wrap_prune_leaves_target_sparsity_in_the_last_checkpoint(compose_cfg):
    if "wrap" not in compose_cfg():
        pytest.skip("conf/config.yaml has no `wrap` group in its defaults yet (lead integrates)")
    from trainer.save_backends import load_checkpoint
    from trainer.training import resume
    from trainer.training.loop import train

    cfg = compose_cfg("wrap=prune", "wrap.frequency=1", "wrap.target_sparsity=0.6")
    train(cfg)
    latest = resume.resolve_resume("latest", None, Path(cfg.run_dir))
    model = load_checkpoint(latest).model
    rows = [r for r in sparsity_report(model)["layers"] if r["wrapped"]]
    assert rows and plain_count(model) == 0
    assert all(r["zeros"] == round(0.6 * r["size"]) for r in rows), rows
