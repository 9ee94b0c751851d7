"""Errors that say what is really wrong (issue 14): a readable checkpoint whose class cannot
be rebuilt from the config it saved is a ``RebuildError`` (also a ``TypeError``, as in Keras)
naming the class and its own error, not a damaged checkpoint; and a model whose class
overrides ``compile()`` loads compiled as saved (defect 19) with every backend."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers.fault_corpus import edit_layer
from trainer.errors import CorruptCheckpointError, MissingClassError, RebuildError
from trainer.save_backends import get_backend, load_checkpoint

BACKENDS = ("h5", "weights", "savedmodel")
X = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
Y = np.linspace(0, 1, 16, dtype="float32").reshape(8, 2)


# ------------------------------------------------------------------ classes under test
class Halve:
    """An activation object with get_config but no from_config."""

    def __call__(self, x):
        return x * 0.5

    def get_config(self):
        return {}


class Scale(keras.layers.Layer):
    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


class HoldsLayers(keras.layers.Layer):
    """Its get_config returns layer objects and its from_config does not rebuild them."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x):
        return self.inner(x)

    def get_config(self):
        return {**super().get_config(), "inner": self.inner}


class Refuses(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}

    @classmethod
    def from_config(cls, config):
        raise ValueError("Refuses wants an even number of units")


class Table(keras.layers.Layer):
    """Holds a weight that its parent uses directly: it is never called itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rows = self.add_weight(shape=(3, 2), initializer="ones")
        self.built = True

    @classmethod
    def from_config(cls, config):
        raise ValueError("Table wants its rows back")


class Net(keras.Model):
    """A functional model subclass with its own constructor and a failing from_config."""

    def __init__(self, units=2, **kwargs):
        inputs = keras.Input((3,))
        super().__init__(inputs, keras.layers.Dense(units)(inputs), **kwargs)
        self.units = units

    def get_config(self):
        return {"units": self.units, "name": self.name}

    @classmethod
    def from_config(cls, config):
        raise ValueError("Net cannot be rebuilt: the units table is gone")


def functional(layer, features=3):
    inputs = keras.Input((features,))
    return keras.Model(inputs, layer(inputs))


def saved(model, backend, tmp_path):
    if not model.compiled:
        model.compile(optimizer="adam", loss="mse")
    return get_backend(backend).save(model, tmp_path / "ckpt")


def rebuild_refused(path, custom_objects, *words):
    """Load ``path`` expecting a RebuildError whose message holds ``words``."""
    with pytest.raises(RebuildError) as info:
        load_checkpoint(path, custom_objects=custom_objects)
    error = info.value
    assert isinstance(error, TypeError)
    assert not isinstance(error, CorruptCheckpointError)
    message = str(error)
    for word in (*words, "custom_objects", "from_config", "Received: "):
        assert word in message, (word, message)
    assert "damaged" not in message
    return error


# ------------------------------------------------------------- classes that do not rebuild
@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_class_without_from_config_is_a_rebuild_error(tmp_path, backend):
    path = saved(functional(keras.layers.Dense(2, activation=Halve())), backend, tmp_path)
    error = rebuild_refused(path, {"Halve": Halve}, "'Halve'", "missing a `from_config()`")
    assert "Unable to reconstruct an instance" in str(error)  # Keras's own words, kept


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_get_config_holding_layers_is_a_rebuild_error(tmp_path, backend):
    path = saved(functional(HoldsLayers(Scale(0.5))), backend, tmp_path)
    objects = {"HoldsLayers": HoldsLayers, "Scale": Scale}
    error = rebuild_refused(path, objects, "'HoldsLayers'", "deserialize_keras_object")
    assert "are explicitly deserialized" in str(error)  # Keras's own words, kept


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_failing_from_config_is_named_with_its_own_error(tmp_path, backend):
    path = saved(functional(Refuses(2)), backend, tmp_path)
    error = rebuild_refused(path, {"Refuses": Refuses}, "Refuses.from_config()")
    assert "ValueError: Refuses wants an even number of units" in str(error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_subclass_with_failing_from_config(tmp_path, backend):
    """Defect 23 (the error half): savedmodel said "damaged" (with the error of a plain
    Functional fallback) although the class was given and its from_config failed. The
    model class the user handed over is theirs to fix: every backend raises RebuildError
    (savedmodel revives only a missing class, or a failing layer inside, from traces)."""
    model = Net()
    model.compile(optimizer="adam", loss="mse")
    path = saved(model, backend, tmp_path)
    error = rebuild_refused(path, {"Net": Net}, "Net.from_config()", "units table is gone")
    assert "Unrecognized keyword" not in str(error)


def test_savedmodel_layer_without_traced_call_names_its_failing_from_config(tmp_path):
    """A layer that is never called has no traced function to fall back on; when its class
    is given but its from_config fails, that failure is the error, not "class not found"."""

    class Outer(keras.layers.Layer):  # local: missing at load, revived from its traces
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.table = Table()

        def call(self, x):
            return keras.ops.matmul(x, self.table.rows)  # the table itself is never called

    path = saved(functional(Outer()), "savedmodel", tmp_path)
    rebuild_refused(path, {"Table": Table}, "Table.from_config()", "wants its rows back")


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_missing_class_is_still_a_missing_class(tmp_path, backend):
    path = saved(functional(Refuses(2)), backend, tmp_path)
    with pytest.raises(MissingClassError, match="Refuses"):
        load_checkpoint(path)


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_damaged_config_of_a_keras_layer_next_to_a_user_layer_is_still_damage(tmp_path, backend):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, name="head")(Scale(2.0, name="scale")(inputs))
    path = saved(keras.Model(inputs, outputs), backend, tmp_path)
    edit_layer(backend, path, "head", lambda item: item["config"].update(units="two"))
    with pytest.raises(CorruptCheckpointError) as info:
        load_checkpoint(path, custom_objects={"Scale": Scale})
    assert not isinstance(info.value, RebuildError)


# ----------------------------------------------------------- models overriding compile()
class Small(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


class FixedCompile(Small):
    """Ignores the arguments it is given (defect 19's example)."""

    def compile(self, *args, **kwargs):
        super().compile(optimizer="adam", loss="mse")


class RateCompile(Small):
    """Takes other arguments than keras.Model.compile."""

    def compile(self, learning_rate=0.05):
        super().compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9), loss="mse")


class TrackingCompile(Small):
    """Passes its arguments on and sets up more: that part must run at load too."""

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self.compiled_by_me = True


class ClippingCompile(Small):
    """Derives what it passes on: given the stored arguments, it would clip twice as hard."""

    def compile(self, optimizer="sgd", loss="mse", **kwargs):
        clipnorm = keras.optimizers.get(optimizer).get_config()["clipnorm"] or 4.0
        super().compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=clipnorm / 2), loss=loss)


class HookCompile(RateCompile):
    """Keras's protocol for a custom compile: its own config and compile_from_config."""

    def get_compile_config(self):
        return {"rate": float(self.optimizer.learning_rate.numpy())}

    def compile_from_config(self, config):
        self.compile(learning_rate=config["rate"])


class BrokenHook(HookCompile):
    def compile_from_config(self, config):
        raise KeyError("no 'schedule' in the compile config")


COMPILE_CLASSES = [FixedCompile, RateCompile, TrackingCompile, ClippingCompile, HookCompile]


def trained(cls, **compile_args):
    keras.utils.set_random_seed(1)
    model = cls()
    model.compile(**compile_args)
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", COMPILE_CLASSES, ids=lambda c: c.__name__)
def test_model_overriding_compile_loads_compiled_as_saved(tmp_path, backend, cls):
    args = {"loss": "mse"} if cls is TrackingCompile else {}
    model = trained(cls, **args)
    path = saved(model, backend, tmp_path)
    loaded = load_checkpoint(path, custom_objects={cls.__name__: cls}).model
    assert type(loaded) is cls and loaded.compiled
    assert type(loaded.optimizer) is type(model.optimizer)
    unnamed = [{**m.optimizer.get_config(), "name": None} for m in (loaded, model)]
    assert unnamed[0] == unnamed[1]
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    if cls is TrackingCompile:
        assert loaded.compiled_by_me
    model.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    loaded.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    for mine, theirs in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failing_compile_from_config_is_a_rebuild_error(tmp_path, backend):
    original = trained(BrokenHook)
    path = saved(original, backend, tmp_path)
    with pytest.raises(RebuildError) as info:
        load_checkpoint(path, custom_objects={"BrokenHook": BrokenHook})
    message = str(info.value)
    assert "BrokenHook.compile_from_config()" in message and "schedule" in message
    assert "compile=False" in message and "Received: KeyError" in message
    model = load_checkpoint(path, custom_objects={"BrokenHook": BrokenHook}, compile=False).model
    assert not model.compiled
    np.testing.assert_allclose(model.predict(X, verbose=0), original.predict(X, verbose=0))
