"""Data sets behind ``conf/data`` and the seeded, resumable input pipeline.

Each epoch's order is a permutation drawn from ``(seed, epoch)`` alone, so any epoch can be
rebuilt in any process and a resumed run can skip the batches it already consumed.
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from pathlib import Path

import numpy as np
import tensorflow as tf

from trainer.errors import ConfigError, DataError


@dataclasses.dataclass
class DataSplits:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def split(x: np.ndarray, y: np.ndarray, validation_split: float, seed: int) -> DataSplits:
    """Hold out a seeded, fixed fraction for validation."""
    if not 0.0 <= validation_split < 1.0:
        raise ValueError(
            f"validation_split must be in [0, 1); set trainer.validation_split accordingly. "
            f"Received {validation_split!r}"
        )
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = round(len(x) * validation_split)
    val, train = order[:n_val], order[n_val:]
    if not len(train):
        raise ConfigError(
            f"No training examples are left: {len(x)} example(s), {n_val} held out for "
            f"validation. Use more examples or a smaller trainer.validation_split. "
            f"Received: {len(x)} examples, validation_split={validation_split!r}"
        )
    num_classes = int(y.max()) + 1
    return DataSplits(x[train], y[train], x[val], y[val], num_classes)


def load_digits(validation_split: float = 0.2, seed: int = 0) -> DataSplits:
    """The real 8x8 handwritten digits (1797 images, 10 classes), shipped in the package.

    ``digits.npz`` holds the same values, image for image, as scikit-learn's
    ``load_digits()`` (the UCI "Optical Recognition of Handwritten Digits" test set, CC BY
    4.0), stored as uint8 (45 KB). Why not scikit-learn itself, as before: once scikit-learn
    is installed, every ``import keras`` imports it (for Keras's scikit-learn wrappers),
    which cost each process that imports TensorFlow about 2.5 s of CPU, a third of the
    import, for one 45 KB array.
    """
    with (resources.files("trainer") / "digits.npz").open("rb") as stream, np.load(stream) as f:
        images, target = f["images"], f["target"]
    x = (images / 16.0).astype("float32")[..., None]
    return split(x, target.astype("int32"), validation_split, seed)


def make_synthetic(
    num_examples: int = 256,
    image_size: int = 8,
    num_classes: int = 10,
    validation_split: float = 0.2,
    seed: int = 0,
) -> DataSplits:
    """Learnable random images: each class has its own mean pattern plus noise."""
    for key, value in (
        ("num_examples", num_examples),
        ("image_size", image_size),
        ("num_classes", num_classes),
    ):
        # 0 failed inside NumPy ("zero-size array to reduction operation"), and
        # image_size=0 aborted the process in oneDNN (exit 134).
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"data.{key} must be a whole number of at least 1 (data=synthetic generates "
                f"num_examples images of image_size x image_size in num_classes classes). "
                f"Received: data.{key}={value!r}"
            )
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(num_classes, image_size, image_size, 1)).astype("float32")
    y = rng.integers(0, num_classes, size=num_examples).astype("int32")
    noise = rng.normal(scale=0.5, size=(num_examples, image_size, image_size, 1))
    x = (means[y] + noise).astype("float32")
    return split(x, y, validation_split, seed)


def load_npz(
    path: str | os.PathLike,
    x_key: str = "x",
    y_key: str = "y",
    validation_split: float = 0.2,
    seed: int = 0,
) -> DataSplits:
    """User arrays from an ``.npz`` file (integer class labels); pickled objects are refused.

    Everything a run could not train on, or would train on wrongly, is a ``ConfigError``
    before anything is written: float labels such as 1.7 would be truncated to class 1
    without a word, and string or negative labels would fail inside ``fit``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data=npz needs an existing .npz file; set data.path=/path/to/file.npz. "
            f"Received path={str(path)!r}"
        )
    try:
        with np.load(path, allow_pickle=False) as arrays:
            missing = [k for k in (x_key, y_key) if k not in arrays.files]
            if missing:
                raise ConfigError(
                    f"{path} has no array named {missing}; set data.x_key / data.y_key to "
                    f"the right names. Received arrays: {arrays.files}"
                )
            x, y = arrays[x_key], arrays[y_key]
    except (OSError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(
            f"{path} cannot be read as an .npz of plain arrays (object arrays need pickle, "
            f"which is refused; save with numeric dtypes). Received "
            f"{type(error).__name__}: {error}"
        ) from None
    return split(_features(path, x, x_key), _labels(path, y, y_key, len(x)), validation_split, seed)


def _features(path: Path, x: np.ndarray, key: str) -> np.ndarray:
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool) or x.ndim < 2 or not len(x):
        raise DataError(
            f"{path}: data.x_key={key!r} must hold one numeric array per example (at least "
            f"one example, at least 2 dimensions). Received dtype {x.dtype}, shape {x.shape}"
        )
    features = x.astype("float32")
    refuse_non_finite(features, f"{path}: data.x_key={key!r}")
    return features


def refuse_non_finite(values: np.ndarray, where: str) -> None:
    """NaN or infinite features make the first weights NaN at the first step; the run then
    "trains" on without a word and its checkpoints hold NaN. Refuse them when the data is
    loaded, naming the first one (also values that overflow float32, such as 1e39)."""
    finite = np.isfinite(values)
    if finite.all():
        return
    first = tuple(int(i) for i in np.argwhere(~finite)[0])
    raise DataError(
        f"{where} holds {int((~finite).sum())} NaN or infinite values (in "
        f"{int((~finite).reshape(len(values), -1).any(axis=1).sum())} of {len(values)} "
        f"examples), which would make the model's weights NaN: clean them or drop those "
        f"examples before saving the arrays. Received {values[first]} at index {list(first)}"
    )


def _labels(path: Path, y: np.ndarray, key: str, examples: int) -> np.ndarray:
    """Integer class ids, one per example: integers, or floats that are whole numbers."""
    where = f"{path}: data.y_key={key!r}"
    if y.ndim != 1 or len(y) != examples:
        raise ConfigError(
            f"{where} must hold one integer class label per example ({examples} examples; "
            f"one-hot labels: save their argmax). Received shape {y.shape}"
        )
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise ConfigError(
            f"{where} must hold integer class labels 0..N-1; map names to ids before saving. "
            f"Received dtype {y.dtype}, first labels {y[:3].tolist()}"
        )
    if y.dtype.kind == "f":
        refuse_non_finite(y, where)
        fractional = y != np.round(y)
        if fractional.any():
            raise DataError(
                f"{where} must hold class labels that are whole numbers; a float label "
                f"would be truncated to another class. Received labels such as "
                f"{y[fractional][:3].tolist()}"
            )
    outside = (y < 0) | (y > np.iinfo(np.int32).max)
    if outside.any():
        raise DataError(
            f"{where} must hold class ids from 0 up (0..N-1 for N classes); negative or "
            f"oversized ids fail inside training. Map them to 0..N-1 before saving. Received "
            f"labels such as {y[outside][:3].tolist()} (the first at index "
            f"{int(np.argmax(outside))})"
        )
    return y.astype("int32")


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The example order of ``epoch``: a function of the run seed and the epoch only."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def steps_per_epoch(num_examples: int, batch_size: int, limit: int | None = None) -> int:
    steps = -(-num_examples // batch_size)
    return min(steps, limit) if limit else steps


def epoch_dataset(
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    skip_batches: int = 0,
    max_batches: int | None = None,
) -> tf.data.Dataset:
    """Batches of ``epoch`` in its seeded order, starting after ``skip_batches`` batches."""
    order = epoch_order(len(x), seed, epoch)
    stop = len(order) if max_batches is None else min(len(order), max_batches * batch_size)
    order = order[skip_batches * batch_size : stop]
    dataset = tf.data.Dataset.from_tensor_slices((x[order], y[order]))
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def run_dataset(
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    epochs: int,
    first_epoch: int = 0,
    skip_batches: int = 0,
    max_batches: int | None = None,
) -> tf.data.Dataset:
    """Every remaining epoch's batches, in order, as one dataset for a single ``fit``.

    Epoch ``e`` is ``epoch_dataset(..., epoch=e)``: its seeded order, capped at
    ``max_batches``; the first epoch starts after ``skip_batches`` (a resumed epoch). A batch
    never spans two epochs, so every epoch ends on the same (possibly partial) batch as a run
    that never stopped. The orders are computed up front (``epochs x examples`` indices) and
    the examples gathered per batch; each epoch keeps its own ``batch`` op so that
    tf.distribute can split every batch over replicas. The cardinality is exact, so Keras
    knows the number of batches.
    """
    steps = steps_per_epoch(len(x), batch_size, max_batches)
    per_epoch = min(len(x), steps * batch_size)
    dtype = np.int32 if len(x) < 2**31 else np.int64
    first = epoch_order(len(x), seed, first_epoch)[skip_batches * batch_size : per_epoch]
    rest = np.stack(
        [epoch_order(len(x), seed, e)[:per_epoch] for e in range(first_epoch + 1, epochs)]
        or [np.zeros(per_epoch, dtype)]
    ).astype(dtype)[: max(0, epochs - first_epoch - 1)]
    indices = tf.data.Dataset.from_tensor_slices(first.astype(dtype)).batch(batch_size)
    indices = indices.concatenate(
        tf.data.Dataset.from_tensor_slices(rest).flat_map(
            lambda row: tf.data.Dataset.from_tensor_slices(row).batch(batch_size)
        )
    )
    total = -(-len(first) // batch_size) + len(rest) * steps
    features, labels = tf.constant(x), tf.constant(y)
    dataset = indices.apply(tf.data.experimental.assert_cardinality(total)).map(
        lambda batch: (tf.gather(features, batch), tf.gather(labels, batch))
    )
    return dataset.prefetch(tf.data.AUTOTUNE)


def eval_dataset(x: np.ndarray, y: np.ndarray, batch_size: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
