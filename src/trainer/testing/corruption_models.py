"""The corruption fuzzer's small trained models, and what "identical" means for a load.

``trainer.testing.corruption`` damages copies of real checkpoints and loads them in a child
process. For that child to say whether a damaged copy loaded "identical to the original", the
original's values are written beside it (``write_reference``, one ``.npz`` file) and compared
bitwise after each load (``compare``): outputs on fixed inputs, every model variable and every
optimizer variable by path, and the training state. No tolerance: everything runs on CPU, and
a load that differs by one bit is a load that differs.

The models (``FUZZ_MODELS``) cover what the readers must rebuild in different ways: a
BatchNormalization (non-trainable statistics), adapted preprocessing layers (Normalization
statistics and a StringLookup vocabulary on a string input), and a subclassed model around a
custom layer registered with Keras (package ``trainer_fuzz``). This module must be imported
wherever such a checkpoint is loaded: the fuzzer's child process does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer.save_backends import LoadedCheckpoint, get_backend
from trainer.state import TrainingState

FUZZ_MODELS = ("batchnorm", "preprocessing", "subclassed")
SEED = 36
WORDS = np.array(["red", "green", "blue", "red", "tan", "green", "red", "sky"], "<U16")


@keras.saving.register_keras_serializable(package="trainer_fuzz")
class FuzzScale(keras.layers.Layer):
    """A custom layer with a trainable scale and a non-trainable count of training calls."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, inputs, training=None):
        if training:
            self.calls.assign_add(1.0)
        return inputs * self.scale


@keras.saving.register_keras_serializable(package="trainer_fuzz")
class FuzzSubclassed(keras.Model):
    """A ``keras.Model`` subclass around ``FuzzScale``; sublayers named, so that the paths
    of their variables do not depend on what else the process built."""

    def __init__(self, units: int = 8, num_outputs: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.units, self.num_outputs = units, num_outputs
        self.hidden = keras.layers.Dense(units, activation="relu", name="hidden")
        self.scaling = FuzzScale(name="scaling")
        self.head = keras.layers.Dense(num_outputs, name="head")

    def call(self, inputs, training=None):
        return self.head(self.scaling(self.hidden(inputs), training=training))

    def get_config(self):
        return {"units": self.units, "num_outputs": self.num_outputs, "name": self.name}


def build(kind: str) -> keras.Model:
    """A compiled, built, untrained model of ``kind`` (one of ``FUZZ_MODELS``)."""
    keras.utils.set_random_seed(SEED)
    if kind == "batchnorm":
        inputs = keras.Input((6,), name="x")
        hidden = keras.layers.Dense(8, name="dense_in")(inputs)
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden), name="bn")
        model.compile(keras.optimizers.Adam(0.01), "mse")
    elif kind == "preprocessing":
        numbers = keras.Input((4,), name="numbers")
        words = keras.Input((1,), dtype="string", name="words")
        normalize = keras.layers.Normalization(name="normalize")
        normalize.adapt(_numbers(64))
        lookup = keras.layers.StringLookup(name="lookup")
        lookup.adapt(WORDS.reshape(-1, 1))
        embedded = keras.layers.Embedding(lookup.vocabulary_size(), 3, name="embed")(lookup(words))
        joined = keras.layers.Concatenate(name="join")(
            [normalize(numbers), keras.layers.Flatten(name="flat")(embedded)]
        )
        model = keras.Model([numbers, words], keras.layers.Dense(2, name="head")(joined))
        model.compile(keras.optimizers.Adam(0.01), "mse")
    elif kind == "subclassed":
        model = FuzzSubclassed(name="fuzz_subclassed")
        model(np.zeros((1, 6), "float32"))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    else:
        raise ValueError(f"Unknown fuzz model; valid: {FUZZ_MODELS}. Received: {kind!r}")
    return model


def _numbers(count: int, offset: int = 0) -> np.ndarray:
    rng = np.random.default_rng(SEED + offset)
    return rng.normal(3.0, 2.0, size=(count, 4)).astype("float32")


def probe(kind: str, count: int = 8, offset: int = 1) -> Any:
    """Fixed inputs for ``kind`` (``offset`` picks other ones, for training data)."""
    if kind == "preprocessing":
        words = np.roll(WORDS, offset)[np.arange(count) % len(WORDS)].reshape(-1, 1)
        words[-1, 0] = "never seen"  # the out-of-vocabulary index too
        return {"numbers": _numbers(count, offset), "words": words}
    return np.random.default_rng(SEED + offset).normal(size=(count, 6)).astype("float32")


def train(model: keras.Model, kind: str, steps: int) -> None:
    """``steps`` optimizer steps of 8 samples each, the same data every time."""
    x = probe(kind, 8 * steps, offset=2)
    width = outputs(model, probe(kind, 1)).shape[-1]
    y = np.random.default_rng(SEED).normal(size=(8 * steps, width))
    data = tf.data.Dataset.from_tensor_slices((x, y.astype("float32"))).batch(8)
    model.fit(data, epochs=1, shuffle=False, verbose=0)


def save_run(backend: str, kind: str, directory: Path) -> tuple[Path, Path, Path]:
    """Two consecutive checkpoints of one short run of ``kind`` (4 steps, then 1 more) and
    the reference values of the first: ``(original, successor, reference)``."""
    directory = Path(directory)
    model = build(kind)
    train(model, kind, steps=4)
    state = TrainingState(epoch=1, global_step=4, seed=SEED, metrics={"loss": 0.5})
    save = get_backend(backend).save
    original = save(model, directory / f"{kind}-1", state=state)
    reference = write_reference(model, probe(kind), state, directory / f"{kind}-1.npz")
    train(model, kind, steps=1)
    successor = save(model, directory / f"{kind}-2", state=TrainingState(epoch=2, global_step=5))
    return original, successor, reference


# ---------------------------------------------------------------- reference values
def values(model: keras.Model) -> dict[str, np.ndarray]:
    """Every model variable (``model/<path>``) and optimizer variable (``optimizer/<path>``)
    by path; a path seen twice gets ``#2``, ``#3``... Paths are taken without the model's
    or the optimizer's own name (``adam_3/``: a count of the optimizers the process built
    before), and a subclassed model's variables (and the optimizer's slots named after
    them) have its name in their path or not, depending on how it was built: neither says
    anything about the checkpoint."""
    found: dict[str, np.ndarray] = {}
    optimizer = getattr(model, "optimizer", None)
    groups = [("model", model.variables, (f"{model.name}/",))]
    if optimizer is not None:  # slots: "adam/<model name>_dense_kernel_momentum"
        groups.append(("optimizer", optimizer.variables, (f"{optimizer.name}/", f"{model.name}_")))
    for group, variables, owners in groups:
        for variable in variables:
            path = variable.path
            for owner in owners:
                path = path.removeprefix(owner)
            key, count = f"{group}/{path}", 1
            while key in found:
                count += 1
                key = f"{group}/{path}#{count}"
            found[key] = np.asarray(keras.ops.convert_to_numpy(variable))
    return found


def outputs(model: keras.Model, inputs: Any) -> np.ndarray:
    """A direct call in inference mode (several inputs go in as tensors: Keras takes no
    NumPy str, nor a mix of arrays and tensors)."""
    if isinstance(inputs, dict):
        inputs = {k: tf.constant(v) for k, v in inputs.items()}
    return np.asarray(keras.ops.convert_to_numpy(model(inputs, training=False)))


def write_reference(
    model: keras.Model, inputs: Any, state: TrainingState, path: os.PathLike
) -> Path:
    """Save what a load of ``model``'s checkpoint must give back, for ``compare``."""
    arrays = {f"value:{k}": v for k, v in values(model).items()}
    named = inputs if isinstance(inputs, dict) else {"": inputs}
    arrays.update({f"input:{k}": v for k, v in named.items()})
    arrays["output"] = outputs(model, inputs)
    arrays["state"] = np.array(state.to_json())
    np.savez(path, **arrays)
    return Path(path)


def compare(checkpoint: LoadedCheckpoint, reference: os.PathLike) -> str | None:
    """None if the load is bitwise the reference; otherwise the first difference found."""
    with np.load(reference, allow_pickle=False) as stored:
        data = {k: stored[k] for k in stored.files}
    expected_state = json.loads(str(data.pop("state")))
    if json.loads(checkpoint.state.to_json()) != expected_state:
        return f"training state {checkpoint.state.to_dict()} instead of {expected_state}"
    model = checkpoint.model
    if getattr(model, "optimizer", None) is None:
        return "the model came back without an optimizer"
    loaded = values(model)
    expected = {k.removeprefix("value:"): v for k, v in data.items() if k.startswith("value:")}
    if sorted(loaded) != sorted(expected):
        return f"variables {sorted(set(loaded) ^ set(expected))[:4]} in one but not the other"
    for key, value in expected.items():
        if not _same(loaded[key], value):
            return f"{key} differs"
    inputs = {k.removeprefix("input:"): v for k, v in data.items() if k.startswith("input:")}
    try:
        result = outputs(model, inputs.get("", inputs))
    except Exception as error:
        return f"calling the loaded model raised {type(error).__name__}: {str(error)[:200]}"
    return None if _same(result, data["output"]) else "outputs differ"


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality: same dtype, shape and bytes (NaN equals the same NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
