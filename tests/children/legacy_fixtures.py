"""Write the legacy tf.keras SavedModel zoo the legacy-import tests read.

Run as its own process (``python tests/children/legacy_fixtures.py OUT``): it imports ``tf_keras``
(Keras 2), which must never share a process with Keras 3. For each case it writes
``OUT/<case>/model`` (``model.save``: the legacy SavedModel, after one training step so the
checkpoint holds optimizer slots), ``x*.npy`` inputs, ``y.npy`` targets, ``trainable.json``
(the trainable variables' shapes), ``pred.npy`` (inference outputs) and, where training=True
is deterministic, ``pred_train.npy``; the
``impostor`` case also ``model_notraces`` (``save_traces=False``). Then
``OUT/builtin_configs.json``: what tf_keras records for its own layer classes
(``legacy_builtin_configs.py``), in the same process so that it costs no tf_keras import.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tf_keras as k

L = k.layers


class Block(L.Layer):
    """A custom layer with nested sublayers (Dense + BatchNormalization) and a scale."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = L.Dense(units, activation="relu", name="inner", kernel_regularizer="l2")
        self.norm = L.BatchNormalization(name="norm")

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(self.units,), initializer="ones")
        super().build(input_shape)

    def call(self, x, training=None):
        return self.norm(self.inner(x), training=training) * self.scale

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class ReLU(L.Layer):
    """Not Keras' ReLU: an unregistered custom class that only shares its name, so Keras 2
    records it as "ReLU" with the base layer's config (name, trainable, dtype)."""

    def call(self, x):
        return x * 2.0 - 1.0


def mlp():
    model = k.Sequential(
        [
            L.Dense(8, activation="relu", input_shape=(5,), kernel_regularizer="l2"),
            L.Dense(3, activation="softmax"),
        ]
    )
    model.compile(k.optimizers.Adam(0.01), "sparse_categorical_crossentropy", ["accuracy"])
    x = np.random.rand(16, 5).astype("float32")
    return model, [x], np.random.randint(0, 3, 16), True


def functional():
    a = k.Input((4,), name="a")
    b = k.Input((3,), name="b")
    h = L.Concatenate()([L.Dense(6, activation="tanh")(a), b])
    out1 = L.Dense(2, name="out1")(h)
    out2 = L.Dense(1, activation="sigmoid", name="out2")(L.Dense(5)(h))
    model = k.Model([a, b], [out1, out2])
    model.compile(k.optimizers.Adam(0.01), ["mse", "binary_crossentropy"])
    xs = [np.random.rand(16, 4).astype("float32"), np.random.rand(16, 3).astype("float32")]
    y = [np.random.rand(16, 2).astype("float32"), np.random.randint(0, 2, (16, 1))]
    return model, xs, y, True


def cnn():
    model = k.Sequential(
        [
            L.InputLayer((8, 8, 3)),
            L.Conv2D(4, 3, padding="same"),
            L.BatchNormalization(),
            L.Activation("relu"),
            L.MaxPooling2D(),
            L.Dropout(0.3),
            L.Flatten(),
            L.Dense(2),
        ]
    )
    model.compile(
        k.optimizers.SGD(0.05, momentum=0.9),
        k.losses.SparseCategoricalCrossentropy(from_logits=True),
        ["accuracy"],
    )
    x = np.random.rand(8, 8, 8, 3).astype("float32")
    return model, [x], np.random.randint(0, 2, 8), False


def rnn():
    tokens = k.Input((6,), dtype="int32", name="tokens")
    h = L.Embedding(20, 5, mask_zero=True)(tokens)
    h = L.LSTM(4, return_sequences=True)(h)
    h = L.GRU(3)(h)
    out = L.Dense(1)(h)
    model = k.Model(tokens, out)
    model.compile(k.optimizers.RMSprop(0.01), "mse")
    x = np.random.randint(1, 20, (8, 6)).astype("int32")
    x[:, 4:] = 0  # padding: the mask matters
    return model, [x], np.random.rand(8, 1).astype("float32"), True


def custom():
    """A Block at the top level and one inside a nested Sequential (Keras 2 numbered a
    nested model's calls from 1; its missing class is revived inside the rebuilt model)."""
    inputs = k.Input((5,))
    h = Block(4, name="block")(inputs)
    nested = k.Sequential([L.InputLayer((4,)), Block(3, name="block_n")], name="nested")
    out = L.Dense(2)(nested(h))
    model = k.Model(inputs, out)
    model.compile(k.optimizers.Adam(0.01), "mse")
    x = np.random.rand(16, 5).astype("float32")
    return model, [x], np.random.rand(16, 2).astype("float32"), True


def mobilenet():
    model = k.applications.MobileNetV2(weights=None, alpha=0.35, input_shape=(32, 32, 3), classes=5)
    model.compile(k.optimizers.Adam(0.001), "sparse_categorical_crossentropy")
    x = np.random.rand(4, 32, 32, 3).astype("float32")
    return model, [x], np.random.randint(0, 5, 4), True


def lam():
    inputs = k.Input((4,))
    h = L.Dense(3)(inputs)
    h = L.Lambda(lambda t: t * 2.0 + 1.0, name="affine")(h)
    out = L.Dense(1)(h)
    model = k.Model(inputs, out)
    model.compile(k.optimizers.Adam(0.01), "mse")
    x = np.random.rand(16, 4).astype("float32")
    return model, [x], np.random.rand(16, 1).astype("float32"), True


def impostor():
    """A weightless custom layer named like a built-in (``ReLU``) between two Dense: rebuilt
    as Keras' ReLU it would compute something else. Also saved without traces."""
    inputs = k.Input((4,), name="impostor_in")
    h = L.Dense(3, name="impostor_dense")(inputs)
    h = ReLU(name="fake_relu")(h)
    out = L.Dense(1, name="impostor_out")(h)
    model = k.Model(inputs, out)
    model.compile(k.optimizers.Adam(0.01), "mse")
    x = np.random.randn(16, 4).astype("float32")
    return model, [x], np.random.rand(16, 1).astype("float32"), True


def convattn():
    """The layers Keras 3 refused to rebuild from tf_keras' default configs before (issue
    18): RandomFlip, SeparableConv2D, Conv2DTranspose, SpatialDropout2D, a self-attention
    MultiHeadAttention whose value and attention mask are call kwargs (tensors Keras 3 must
    resolve), and a Dense with Keras 2's ``hard_sigmoid`` (another function in Keras 3).
    The attention has no biases: softmax ignores the key bias, whose gradient is rounding
    noise (the fit test wants every variable trained)."""
    image = k.Input((8, 8, 3), name="ca_image")
    mask = k.Input((16, 16), dtype="bool", name="ca_mask")
    h = L.RandomFlip("horizontal", name="ca_flip")(image)
    h = L.Conv2D(4, 3, strides=2, padding="same", activation="relu", name="ca_conv")(h)
    h = L.SeparableConv2D(6, 3, padding="same", activation="relu", name="ca_sep")(h)
    h = L.Conv2DTranspose(4, 3, strides=2, padding="same", name="ca_up")(h)
    h = L.MaxPooling2D(name="ca_pool")(L.SpatialDropout2D(0.2, name="ca_drop")(h))
    h = L.Reshape((16, 4), name="ca_seq")(h)
    attention = L.MultiHeadAttention(2, 4, use_bias=False, name="ca_mha")
    h = attention(h, h, attention_mask=mask)
    h = L.GlobalAveragePooling1D(name="ca_gap")(h)
    h = L.Dense(8, activation="hard_sigmoid", name="ca_hard")(h)
    model = k.Model([image, mask], L.Dense(2, name="ca_out")(h))
    model.compile(k.optimizers.Adam(0.01), k.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.rand(8, 8, 8, 3).astype("float32")
    keep = np.random.rand(8, 16, 16) > 0.3
    keep |= np.eye(16, dtype=bool)  # every query keeps a key: see translate's MHA note
    return model, [x, keep], np.random.randint(0, 2, 8), False


CASES = {
    "mlp": mlp,
    "functional": functional,
    "cnn": cnn,
    "rnn": rnn,
    "custom": custom,
    "mobilenet": mobilenet,
    "lambda": lam,
    "impostor": impostor,  # after the others: tf_keras numbers default layer names globally
    "convattn": convattn,
}


def write(out, name):
    # Python's, NumPy's and TensorFlow's seeds: tf_keras draws an unseeded layer's RNG
    # seed (RandomFlip, Dropout) from Python's ``random``, so NumPy and TensorFlow alone
    # left the one training step, and so the saved weights, different in every run.
    k.utils.set_random_seed(0)
    model, xs, y, train_deterministic = CASES[name]()
    # One step, so that the checkpoint holds optimizer slots. MobileNetV2 skips it and is
    # saved without traces (all its classes are built-in): tracing 150 layers costs ~1 min.
    big = name == "mobilenet"
    if not big:
        model.run_eagerly = True  # no train function to trace: the fixtures stay cheap
        model.fit(xs if len(xs) > 1 else xs[0], y, batch_size=len(xs[0]), epochs=1, verbose=0)
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "model"), save_traces=not big)
    if name == "impostor":  # nothing to revive the impostor from: an error naming it
        model.save(os.path.join(folder, "model_notraces"), save_traces=False)
    # The trainable variables' shapes, which the import must keep trainable (checked for
    # every case, also where the costlier fit test is in the extended tier only).
    with open(os.path.join(folder, "trainable.json"), "w") as file:
        json.dump(sorted(list(v.shape) for v in model.trainable_variables), file)
    for i, x in enumerate(xs):
        np.save(os.path.join(folder, f"x{i}.npy"), x)
    for i, target in enumerate(y if isinstance(y, list) else [y]):
        np.save(os.path.join(folder, f"y{i}.npy"), np.asarray(target))
    feed = xs if len(xs) > 1 else xs[0]
    for suffix, training in (("", False), ("_train", True)):
        if training and not train_deterministic:
            continue
        preds = model(feed, training=training)
        if not training:  # the regularization losses a training step adds
            np.save(os.path.join(folder, "losses.npy"), np.float32(sum(model.losses)))
        for i, p in enumerate(preds if isinstance(preds, list) else [preds]):
            np.save(os.path.join(folder, f"pred{suffix}{i}.npy"), np.asarray(p))
    if big:  # the same network with unfused BatchNormalization, as Keras 3 computes it
        np.save(os.path.join(folder, "pred_train_unfused0.npy"), unfused_output(model, feed))


def unfused_output(model, feed):
    """``model``'s training-mode output with its BatchNormalization layers off the fused
    kernel Keras 2 picks for 4-D inputs (the batch moments are then computed with other ops,
    which round differently); switched back afterwards. Cheaper than a copy (~1 s, not 4)."""
    layers = [layer for layer in model.layers if isinstance(layer, L.BatchNormalization)]
    for layer in layers:
        layer.fused = False
    try:
        return np.asarray(model(feed, training=True))
    finally:
        for layer in layers:
            layer.fused = True


def write_all(out, names=()):
    """Every case (or ``names``) into ``out``; with every case, also the built-in layers'
    configs (``legacy_builtin_configs.py``)."""
    for case in names or list(CASES):
        write(out, case)
    if not names:
        from legacy_builtin_configs import write_configs

        write_configs(os.path.join(out, "builtin_configs.json"))


if __name__ == "__main__":
    write_all(sys.argv[1], sys.argv[2:])
