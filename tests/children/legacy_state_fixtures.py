"""Write the legacy tf.keras SavedModels of
``tests/save_backends/legacy/test_state_beyond_weights.py``: models whose state beyond the
layers' weights (optimizer averages, RNN states, frozen layers, learning rate schedules...)
the import must carry over or refuse.

Run as its own process (``python tests/children/legacy_state_fixtures.py OUT [CASE...]``): it
imports ``tf_keras`` (Keras 2), which must never share a process with Keras 3. Each case writes
``OUT/<case>/model`` and the ``.npy`` files its test compares with: what tf_keras computed
before and after the save (``x``, ``y`` and ``pred`` as in ``legacy_fixtures.py``;
``cont_*``: tf_keras continuing to train the model it had just saved).

Every model is compiled with ``run_eagerly=True``, as in ``legacy_fixtures.py``: its few
steps then trace no train function (tf_keras saves no ``run_eagerly``; the SavedModel's
traces are the same).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tf_keras as k

L = k.layers


def _data(units=3):
    x = np.random.RandomState(0).rand(16, 5).astype("float32")
    y = np.random.RandomState(1).rand(16, units).astype("float32")
    return x, y


def ema(folder):
    """Adam with ``use_ema``: one step before the save (slots and averages exist), two
    after it in tf_keras (``fit`` ends by overwriting the weights with the averages)."""
    x, y = _data()
    model = k.Sequential([L.InputLayer((5,)), L.Dense(3)])
    model.compile(k.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9), "mse", run_eagerly=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    model.save(os.path.join(folder, "model"))
    _save(folder, x=x, y=y, pred=model(x).numpy())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    _save(folder, cont_pred=model(x).numpy())


def stateful(folder):
    """A stateful LSTM saved between two chunks of its sequences (states moved), inside a
    Bidirectional too: ``pred`` is the next chunk, continuing from the saved states.

    Unrolled: tf_keras then saves no cuDNN variant of the layers' functions, whose
    registration with its gradients cost ~18 of this case's ~22 CPU-seconds. The states are
    what this case is about; the default, cuDNN-eligible LSTM and GRU are the import zoo's
    ``rnn`` case (``legacy_fixtures.py``)."""
    x = np.random.RandomState(0).rand(4, 5, 3).astype("float32")
    inputs = k.Input(batch_shape=(4, 5, 3))
    h = L.LSTM(2, stateful=True, return_sequences=True, unroll=True, name="lstm")(inputs)
    h = L.Bidirectional(L.GRU(2, stateful=True, unroll=True), name="bi")(h)
    model = k.Model(inputs, L.Dense(1, name="out")(h))
    model.compile(k.optimizers.Adam(0.01), "mse", run_eagerly=True)
    model(x)
    model.save(os.path.join(folder, "model"))
    _save(folder, x=x, pred=model(x).numpy())


def frozen(folder):
    """Transfer learning: a frozen Dense at the top level and a frozen nested base model
    (Dense + BatchNormalization, which a frozen base runs in inference mode), trained one
    step before the save and three after it."""
    x, y = _data(2)
    base_in = k.Input((5,))
    base = k.Model(
        base_in,
        L.BatchNormalization(name="base_bn")(L.Dense(4, name="base_d")(base_in)),
        name="base",
    )
    base.trainable = False
    inputs = k.Input((5,))
    h = L.Dense(4, activation="relu", name="frozen_d", trainable=False)(base(inputs))
    model = k.Model(inputs, L.Dense(2, name="head")(h))
    model.compile(k.optimizers.Adam(0.05), "mse", run_eagerly=True)
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.save(os.path.join(folder, "model"))
    _save(folder, x=x, y=y, pred=model(x).numpy())
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    _save(folder, cont_pred=model(x).numpy())


LEGACY_OPTIMIZERS = {
    "adam": lambda: k.optimizers.legacy.Adam(0.05, amsgrad=True),
    "sgd": lambda: k.optimizers.legacy.SGD(0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda: k.optimizers.legacy.RMSprop(0.01, momentum=0.5, centered=True),
}


def legacy_optimizers(folder):
    """tf.keras.optimizers.legacy.* (OptimizerV2: slots tied to their variables by the
    checkpoint graph, iteration count ``iter``), two steps before the save, three after."""
    x, y = _data()
    for name, make in LEGACY_OPTIMIZERS.items():
        model = k.Sequential([L.InputLayer((5,)), L.Dense(3)])
        model.compile(make(), "mse", run_eagerly=True)
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        model.save(os.path.join(folder, name))
        losses = [model.train_on_batch(x, y) for _ in range(3)]
        _save(folder, x=x, y=y, **{f"{name}_losses": losses})


SCHEDULES = {
    "exponential": lambda s: s.ExponentialDecay(0.1, decay_steps=3, decay_rate=0.5),
    "piecewise": lambda s: s.PiecewiseConstantDecay([2, 5], [0.1, 0.05, 0.01]),
    "polynomial": lambda s: s.PolynomialDecay(0.1, 10, 0.01, power=2.0, cycle=True),
    "inverse_time": lambda s: s.InverseTimeDecay(0.1, 4, 0.5, staircase=True),
    "cosine": lambda s: s.CosineDecay(0.05, 8, alpha=0.1, warmup_target=0.1, warmup_steps=3),
    "cosine_restarts": lambda s: s.CosineDecayRestarts(0.1, 4, t_mul=2.0, m_mul=0.5),
}


def schedules(folder):
    """SGD with each built-in learning-rate schedule, two steps before the save, three after
    it; ``<name>_rates``: the schedule's rate at steps 0 to 29."""
    x, y = _data()
    for name, make in SCHEDULES.items():
        schedule = make(k.optimizers.schedules)
        model = k.Sequential([L.InputLayer((5,)), L.Dense(3)])
        model.compile(k.optimizers.SGD(schedule, momentum=0.5), "mse", run_eagerly=True)
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        model.save(os.path.join(folder, name))
        losses = [model.train_on_batch(x, y) for _ in range(3)]
        rates = [float(schedule(step)) for step in range(30)]
        _save(folder, x=x, y=y, **{f"{name}_losses": losses, f"{name}_rates": rates})


def mixed(folder):
    """mixed_float16: tf_keras wraps the optimizer in a LossScaleOptimizerV3 (dynamic loss
    scale: doubled after two finite steps here), two steps before the save, three after."""
    x, y = _data()
    k.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = k.Sequential(
            [L.InputLayer((5,)), L.Dense(3), L.Activation("linear", dtype="float32")]
        )
        optimizer = k.mixed_precision.LossScaleOptimizer(
            k.optimizers.Adam(0.01), dynamic_growth_steps=3
        )
        model.compile(optimizer, "mse", run_eagerly=True)
    finally:
        k.mixed_precision.set_global_policy("float32")
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    model.save(os.path.join(folder, "model"))
    scale = [float(model.optimizer.loss_scale), int(model.optimizer.dynamic_counter)]
    _save(folder, x=x, y=y, pred=model(x).numpy(), scale=scale)
    _save(folder, cont_losses=[model.train_on_batch(x, y) for _ in range(3)])
    _save(folder, cont_scale=float(model.optimizer.loss_scale))


def normalization(folder):
    """An adapted Normalization (its mean and variance in variables, not in the config)
    before a Dense, trained one step before the save."""
    x, y = _data(2)
    x = x * 4.0 + 10.0  # mean about 12, variance about 1.3: a swap would show
    norm = L.Normalization(name="norm")
    norm.adapt(x)
    model = k.Sequential([L.InputLayer((5,)), norm, L.Dense(2, name="out")])
    model.compile(k.optimizers.Adam(0.05), "mse", run_eagerly=True)
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.save(os.path.join(folder, "model"))
    _save(folder, x=x, y=y, pred=model(x).numpy())


def metric_names(folder):
    """Metrics by alias and as objects, of a two-output model (tf_keras prefixes them with
    the output's name) and of a one-output model; ``<model>_keys.json``: tf_keras' log keys."""
    x = np.random.RandomState(0).rand(16, 6).astype("float32")
    y = {"cls": np.random.RandomState(1).randint(0, 3, 16), "reg": _data(1)[1]}
    inputs = k.Input((6,), name="a")
    h = L.Dense(8, activation="relu")(inputs)
    outputs = {
        "cls": L.Dense(3, activation="softmax", name="cls")(h),
        "reg": L.Dense(1, name="reg")(h),
    }
    two = k.Model(inputs, outputs)
    metrics = {"cls": ["accuracy"], "reg": ["mae", k.metrics.RootMeanSquaredError()]}
    two.compile(
        "adam",
        {"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        metrics=metrics,
        run_eagerly=True,
    )
    one = k.Sequential([L.InputLayer((6,)), L.Dense(1)])
    one.compile(
        "adam",
        "mse",
        metrics=["mae", "acc", k.metrics.RootMeanSquaredError(name="rmse")],
        run_eagerly=True,
    )
    for name, model, target in (("two", two, y), ("one", one, y["reg"])):
        model.fit(x, target, verbose=0)
        model.save(os.path.join(folder, name))
        keys = sorted(model.evaluate(x, target, verbose=0, return_dict=True))
        with open(os.path.join(folder, f"{name}_keys.json"), "w") as file:
            json.dump(keys, file)
    _save(folder, x=x, y_cls=y["cls"], y_reg=y["reg"])


def slotless(folder):
    """SGD without momentum has no slots, only its iteration count, which a schedule reads:
    tf.keras.optimizers.SGD and the legacy one, two steps before the save, three after."""
    x, y = _data()
    for name, make in (("sgd", k.optimizers.SGD), ("legacy_sgd", k.optimizers.legacy.SGD)):
        model = k.Sequential([L.InputLayer((5,)), L.Dense(3)])
        model.compile(
            make(k.optimizers.schedules.ExponentialDecay(0.2, 1, 0.5)), "mse", run_eagerly=True
        )
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        model.save(os.path.join(folder, name))
        _save(
            folder, x=x, y=y, **{f"{name}_losses": [model.train_on_batch(x, y) for _ in range(3)]}
        )


def _save(folder, **arrays):
    for name, array in arrays.items():
        np.save(os.path.join(folder, f"{name}.npy"), np.asarray(array))


CASES = {
    "ema": ema,
    "stateful": stateful,
    "frozen": frozen,
    "legacy_optimizers": legacy_optimizers,
    "schedules": schedules,
    "mixed": mixed,
    "normalization": normalization,
    "metric_names": metric_names,
    "slotless": slotless,
}


def write_all(out, names=()):
    """Every case (or ``names``) into ``out/<case>``, each from seed 0."""
    for case in names or list(CASES):
        k.utils.set_random_seed(0)
        folder = os.path.join(out, case)
        os.makedirs(folder, exist_ok=True)
        CASES[case](folder)


if __name__ == "__main__":
    write_all(sys.argv[1], sys.argv[2:])
