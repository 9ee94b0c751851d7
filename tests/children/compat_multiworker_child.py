"""Worker process of ``tests/_compat/test_canaries.py::test_multiworker_keras_bugs_still_present``.

``python tests/children/compat_multiworker_child.py`` with ``TF_CONFIG`` set, one per worker of a
two-worker cluster on 127.0.0.1. Runs plain Keras (no workaround) into the two bugs that
``trainer._compat.keras`` works around under ``MultiWorkerMirroredStrategy``, then the same
training with the workarounds, and prints what happened as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from trainer._compat import keras_bugs


def failure(error: BaseException) -> dict:
    return {
        "error": f"{type(error).__name__}: {error}"[:600],
        "frames": [frame.name for frame in traceback.extract_tb(error.__traceback__)],
    }


def tiny_model(strategy: tf.distribute.Strategy) -> keras.Model:
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def main() -> None:
    keras.config.disable_traceback_filtering()  # keep Keras' frames in tracebacks
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x = np.ones((8, 3), "float32")
    y = np.zeros((8, 2), "float32")
    report: dict = {"workarounds_needed": keras_bugs.multiworker_workarounds_needed()}

    # Bug 1: Keras reduces a step's scalar outputs with strategy.reduce("MEAN", v, axis=0).
    per_replica = strategy.run(lambda: tf.constant(1.0))
    try:
        keras_tf_trainer.reduce_per_replica(per_replica, strategy, "auto")
        report["reduce"] = {"error": None}
    except Exception as error:
        report["reduce"] = failure(error)

    # Bug 2: before fit, Keras all-reduces a nested batch of the distributed iterator.
    model = tiny_model(strategy)
    try:
        model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=1, verbose=0)
        report["build"] = {"error": None}
    except Exception as error:
        report["build"] = failure(error)

    # The workarounds: the same training then runs.
    keras_bugs.patch_multiworker_mean_reduction()
    model = tiny_model(strategy)
    keras_bugs.build_from_example_batch(model, (x[:1], y[:1]))
    try:
        history = model.fit(x, y, batch_size=4, epochs=1, steps_per_epoch=2, verbose=0)
        report["patched"] = {"error": None, "loss": float(history.history["loss"][-1])}
    except Exception as error:
        report["patched"] = failure(error)
    print(json.dumps(report))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
