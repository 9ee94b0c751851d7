"""Model zoo for the SavedModel backend tests: each builder returns a small trained model,
its data, and the names of the custom classes a "class missing" test hides from Keras."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np
from keras import layers, ops
from keras.src.saving import object_registration

PKG = "smzoo"


@keras.saving.register_keras_serializable(PKG)
class Scale(layers.Layer):
    """A per-feature trainable scale."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


@keras.saving.register_keras_serializable(PKG)
class Inner(layers.Layer):
    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = layers.Dense(units, kernel_regularizer=keras.regularizers.L2(1e-2))

    def build(self, shape):
        self.dense.build(shape)
        self.gain = self.add_weight(shape=(), initializer="ones", name="gain")

    def call(self, x):
        return self.dense(x) * self.gain

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(PKG)
class Middle(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = Inner(6)
        self.norm = layers.BatchNormalization()

    def call(self, x, training=None):
        return self.norm(self.inner(x), training=training)


@keras.saving.register_keras_serializable(PKG)
class Outer(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.middle = Middle()
        self.head = layers.Dense(2)

    def call(self, x, training=None):
        hidden = self.middle(x, training=training)
        self.add_loss(1e-3 * ops.mean(hidden**2))
        return self.head(hidden)


@keras.saving.register_keras_serializable(PKG)
class TrainingShift(layers.Layer):
    """Behaviour depends on ``training``: adds a (trainable) offset only while training."""

    def build(self, shape):
        self.offset = self.add_weight(shape=(shape[-1],), initializer="ones", name="offset")

    def call(self, x, training=None):
        return x + self.offset if training else x


@keras.saving.register_keras_serializable(PKG)
class MaskWrapper(layers.Wrapper):
    """Pruning-style wrapper: multiplies the wrapped Dense kernel by its own mask."""

    def build(self, shape):
        super().build(shape)
        kernel = self.layer.kernel
        self.mask = self.add_weight(
            shape=kernel.shape, initializer="ones", trainable=False, name="mask"
        )
        self.mask.assign(
            np.tile([1.0, 0.0], kernel.shape[0] * kernel.shape[1] // 2 + 1)[
                : kernel.shape[0] * kernel.shape[1]
            ].reshape(kernel.shape)
        )

    def call(self, x):
        return ops.matmul(x, self.layer.kernel * self.mask) + self.layer.bias


@keras.saving.register_keras_serializable(PKG)
class TinyNet(keras.Model):
    """A subclassed model with its own call."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = layers.Dense(units, activation="relu")
        self.scale = Scale()
        self.out = layers.Dense(3)

    def call(self, x, training=None):
        return self.out(self.scale(self.hidden(x)))

    def get_config(self):
        return {"units": self.units, "name": self.name}


@keras.saving.register_keras_serializable(PKG)
class PeakAccuracy(keras.metrics.Metric):
    def __init__(self, name="peak_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign(ops.maximum(self.total, ops.max(y_pred)))

    def result(self):
        return self.total


def _fit(model, x, y, loss="mse", metrics=None):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=metrics)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    return model


def _data(n=32, shape=(6,), seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *shape)).astype("float32")


def sequential_mlp():
    x, y = _data(), np.random.default_rng(1).integers(0, 3, 32)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            layers.Dense(16, activation="relu"),
            layers.Dropout(0.3),
            Scale(name="scale"),
            layers.Dense(3),
        ],
        name="mlp",
    )
    return _fit(model, x, y, "sparse_categorical_crossentropy", ["accuracy"]), x, y, ["Scale"]


def two_in_two_out():
    a, b = keras.Input((4,), name="left"), keras.Input((3,), name="right")
    joined = layers.Concatenate()([Scale(name="scale_left")(a), b])
    hidden = layers.Dense(8, activation="relu")(joined)
    outputs = {
        "value": layers.Dense(1, name="value")(hidden),
        "probs": layers.Dense(2, activation="softmax", name="probs")(hidden),
    }
    model = keras.Model({"left": a, "right": b}, outputs, name="two_by_two")
    x = {"left": _data(shape=(4,)), "right": _data(shape=(3,), seed=2)}
    y = {"value": _data(shape=(1,), seed=3), "probs": np.eye(2)[np.arange(32) % 2]}
    model.compile(
        optimizer="adam",
        loss={"value": "mse", "probs": "categorical_crossentropy"},
        metrics={"value": ["mae"]},
    )
    model.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    return model, x, y, ["Scale"]


def conv_bn_dropout():
    inputs = keras.Input((8, 8, 2))
    h = layers.Conv2D(4, 3, padding="same")(inputs)
    h = layers.BatchNormalization()(h)
    h = layers.Dropout(0.2)(h)
    h = TrainingShift(name="shift")(layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, layers.Dense(2)(h), name="convnet")
    x, y = _data(shape=(8, 8, 2)), _data(shape=(2,), seed=5)
    return _fit(model, x, y), x, y, ["TrainingShift"]


def nested_three_deep():
    inputs = keras.Input((5,))
    outputs = Outer(name="outer", activity_regularizer="l2")(inputs)
    model = keras.Model(inputs, outputs, name="nested")
    x, y = _data(shape=(5,)), _data(shape=(2,), seed=4)
    return _fit(model, x, y), x, y, ["Outer", "Middle", "Inner"]


def saved_before_and_after_training(directory, seed: int, epochs: int = 1):
    """``nested_three_deep`` saved by the savedmodel backend, trained ``epochs`` more and
    saved again (a repeat save): (backend, model, x, y, first, second)."""
    from trainer.save_backends import get_backend

    keras.utils.set_random_seed(seed)
    model, x, y, _ = nested_three_deep()
    backend = get_backend("savedmodel")
    first = backend.save(model, directory / "first")
    model.fit(x, y, epochs=epochs, verbose=0)
    second = backend.save(model, directory / "second")
    return backend, model, x, y, first, second


def shared_layer():
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    shared = Scale(name="shared")
    dense = layers.Dense(3, name="shared_dense")
    out = layers.Add()([dense(shared(a)), dense(shared(b))])
    model = keras.Model([a, b], out, name="shared")
    x = [_data(shape=(4,)), _data(shape=(4,), seed=9)]
    return _fit(model, x, _data(shape=(3,), seed=7)), x, _data(shape=(3,), seed=7), ["Scale"]


def wrappers():
    inputs = keras.Input((5, 4))
    h = layers.Bidirectional(layers.LSTM(3, return_sequences=True))(inputs)
    h = layers.TimeDistributed(layers.Dense(2))(h)
    h = layers.GRU(4)(h)
    out = MaskWrapper(layers.Dense(4), name="masked")(h)
    model = keras.Model(inputs, layers.Dense(1)(out), name="wrapped")
    x, y = _data(shape=(5, 4)), _data(shape=(1,), seed=8)
    return _fit(model, x, y), x, y, ["MaskWrapper"]


def regularized():
    inputs = keras.Input((6,))
    h = layers.Dense(5, kernel_regularizer="l2", activity_regularizer="l1")(inputs)
    h = Inner(3, name="inner", activity_regularizer=keras.regularizers.L2(1e-3))(h)
    model = keras.Model(inputs, h, name="regularized")
    x, y = _data(), _data(shape=(3,), seed=11)
    return _fit(model, x, y), x, y, ["Inner"]


def subclassed():
    model = TinyNet(name="tiny")
    x, y = _data(), np.random.default_rng(3).integers(0, 3, 32)
    model(x[:2])
    return _fit(model, x, y, "sparse_categorical_crossentropy"), x, y, ["TinyNet", "Scale"]


def custom_metric():
    model = keras.Sequential([keras.Input((6,)), layers.Dense(2)], name="metric_model")
    x, y = _data(), _data(shape=(2,), seed=12)
    return _fit(model, x, y, "mse", [PeakAccuracy(), "mae"]), x, y, ["PeakAccuracy"]


def lambda_layer():
    inputs = keras.Input((6,))
    h = layers.Lambda(lambda t: t * 2.0 + 1.0, name="affine")(inputs)
    model = keras.Model(inputs, layers.Dense(2)(h), name="lambda_model")
    x, y = _data(), _data(shape=(2,), seed=13)
    return _fit(model, x, y), x, y, []


ZOO = {
    "sequential_mlp": sequential_mlp,
    "two_in_two_out": two_in_two_out,
    "conv_bn_dropout": conv_bn_dropout,
    "nested_three_deep": nested_three_deep,
    "shared_layer": shared_layer,
    "wrappers": wrappers,
    "regularized": regularized,
    "subclassed": subclassed,
    "custom_metric": custom_metric,
    "lambda_layer": lambda_layer,
}


@contextlib.contextmanager
def classes_hidden(names: list[str], package: str = PKG) -> Iterator[None]:
    """Remove ``<package>>Name`` (``smzoo>Name`` by default) from Keras' global registry
    for the duration (as if the defining module were never imported), then put them back."""
    objects = object_registration.GLOBAL_CUSTOM_OBJECTS
    names_map = object_registration.GLOBAL_CUSTOM_NAMES
    saved = {}
    for name in names:
        key = f"{package}>{name}"
        if key in objects:
            cls = objects.pop(key)
            saved[key] = (cls, names_map.pop(cls, None))
    try:
        yield
    finally:
        for key, (cls, registered) in saved.items():
            objects[key] = cls
            if registered is not None:
                names_map[cls] = registered


def assert_trains_alike(known, revived, x, y, *, epochs: int = 1, atol: float = 1e-5) -> None:
    """Fit both models the same way: every variable moves alike, and both compute the same
    outputs afterwards with ``training`` False and True (a revived layer must train and
    infer as its class does)."""
    for each in (known, revived):
        each.fit(x, y, epochs=epochs, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(known.variables, revived.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=atol, err_msg=a.path)
    for training in (False, True):
        np.testing.assert_allclose(
            revived(x, training=training).numpy(),
            known(x, training=training).numpy(),
            atol=atol,
            err_msg=f"training={training}",
        )
