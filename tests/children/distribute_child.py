"""Child process of tests/training/test_distribute.py: ``train()`` jobs under a strategy, then
predictions of checkpoints loaded *inside* that strategy's scope.

Logical CPU devices can only be configured before TensorFlow initialises, so this runs in
a fresh interpreter: ``python tests/children/distribute_child.py SPEC.json`` where SPEC holds
``{"jobs": [[override, ...], ...], "strategy": [override, ...],
"predict": {"inputs": X.npy, "checkpoints": {name: path}, "out": OUT.npz},
"canary": OUT.json}``. The canary runs plain Keras (no workaround) into the bug that
``trainer._compat.keras_bugs.build_from_example_batch`` works around under MirroredStrategy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
from hydra import compose, initialize_config_dir

import trainer.training.config  # noqa: F401  (the schemas conf/ extends)
from tests.helpers.paths import CONF_DIR
from trainer import train
from trainer.save_backends import load_checkpoint
from trainer.training import distribute


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose("config", overrides=overrides)


def uneven_first_batch_canary(strategy) -> dict:
    """Plain Keras: fit with a validation set (5 examples) that the 2 replicas split 3/2."""
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    try:
        model.fit(x, y, batch_size=8, epochs=1, validation_data=(x[:5], y[:5]), verbose=0)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:600]}
    return {"error": None}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("canary"):
        dist = distribute.setup(compose_cfg(spec["strategy"]).strategy)
        report = uneven_first_batch_canary(dist.strategy)
        Path(spec["canary"]).write_text(json.dumps(report))
    for overrides in spec["jobs"]:
        train(compose_cfg(overrides))
    predict = spec.get("predict")
    if predict:
        dist = distribute.setup(compose_cfg(spec["strategy"]).strategy)  # the cached one
        x = np.load(predict["inputs"])
        outputs = {}
        for name, path in predict["checkpoints"].items():
            with dist.scope():
                model = load_checkpoint(path).model
            assert model.distribute_strategy is dist.strategy, "not loaded under the strategy"
            outputs[name] = model.predict(x, verbose=0)
        np.savez(predict["out"], **outputs)


if __name__ == "__main__":
    main(sys.argv[1])
