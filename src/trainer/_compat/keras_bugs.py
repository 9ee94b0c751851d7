"""Workarounds of Keras bugs that trainer runs into under ``tf.distribute`` strategies.

Like ``trainer._compat.keras``, each names the private attribute it replaces and the
version it was checked against (Keras 3.15.1, TensorFlow 2.21.0). Each is applied only on
the Keras releases in ``MULTIWORKER_BUGS_IN``; ``tests/_compat/test_canaries.py`` and
``tests/training/test_distribute.py`` hold canaries that run plain Keras into each bug, so they fail
once upstream fixes it (drop the workaround then) or once a Keras release that still has
it is installed but not listed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``3.15.1`` or ``3.16.0.dev2025``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"Unrecognised Keras version {version!r}")
    return int(match.group(1)), int(match.group(2))


KERAS_RELEASE = _release(keras.version())


# Minor versions of Keras on which both multi-worker bugs below were reproduced
# (tests/_compat/test_canaries.py::test_multiworker_keras_bugs_still_present), and the uneven first
# batch under MirroredStrategy (the canary in tests/training/test_distribute.py's mirrored test).
# The workarounds are applied on these versions only.
MULTIWORKER_BUGS_IN = frozenset({(3, 15)})


def multiworker_workarounds_needed(release: tuple[int, int] = KERAS_RELEASE) -> bool:
    """Whether the installed Keras (``release``) is known to need the two workarounds."""
    return release in MULTIWORKER_BUGS_IN


def patch_multiworker_mean_reduction() -> bool:
    """Work around a Keras bug under ``MultiWorkerMirroredStrategy``: Keras reduces every
    step's outputs (scalar metric results) with ``strategy.reduce("MEAN", v, axis=0)``,
    which fails on scalars ("Invalid reduction dimension 0 for input with 0 dimensions",
    tensorflow/tensorflow#72388). Reduce them over replicas with ``axis=None`` instead:
    the mean across replicas, as Keras computes it under ``MirroredStrategy``.

    Replaces ``keras.src.backend.tensorflow.trainer.reduce_per_replica``, a module-level
    function the TensorFlow trainer looks up at every call; nothing public configures
    the reduction. Applied only on the Keras versions in ``MULTIWORKER_BUGS_IN`` (checked:
    Keras 3.15.1, TensorFlow 2.21.0). Idempotent. True if the patch is in place.
    """
    if not multiworker_workarounds_needed():
        return False
    from keras.src.backend.tensorflow import trainer as keras_tf_trainer

    original = keras_tf_trainer.reduce_per_replica
    if getattr(original, "patched_by_trainer", False):
        return True

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        ):
            return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    reduce_per_replica.patched_by_trainer = True
    keras_tf_trainer.reduce_per_replica = reduce_per_replica
    return True


def build_from_example_batch(model: keras.Model, example_batch: tuple) -> bool:
    """Work around a Keras bug under strategies with several replicas: before every
    fit/evaluate, Keras takes a batch from the distributed iterator and all-reduces it
    (nested) only to read its shapes. ``MultiWorkerMirroredStrategy`` rejects that
    ("Attempt to convert a value (PerReplica...)"); ``MirroredStrategy`` fails in the mean's
    ``AddN`` when that first batch splits unevenly over the replicas (a validation set
    smaller than the global batch, or a resumed epoch starting on its last, partial
    batch). Give Keras one plain example batch instead; nothing else about building changes.

    Overrides the private ``Trainer._maybe_symbolic_build`` on this model instance (no
    public hook decides what that build is given). Applied only on the Keras versions in
    ``MULTIWORKER_BUGS_IN`` (checked: Keras 3.15.1, TensorFlow 2.21.0). True if applied.
    """
    if not multiworker_workarounds_needed():
        return False
    original: Callable[..., Any] = model._maybe_symbolic_build

    def symbolic_build(iterator=None, data_batch=None):
        original(data_batch=example_batch if iterator is not None else data_batch)

    model._maybe_symbolic_build = symbolic_build
    return True
