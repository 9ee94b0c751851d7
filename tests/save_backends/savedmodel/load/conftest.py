"""Fixtures shared by the savedmodel load tests."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest

from trainer.save_backends import get_backend


@pytest.fixture(scope="module")
def save_trained(tmp_path_factory):
    """``save_trained(build, data)`` -> (model, checkpoint path): ``build()`` with seed 0,
    compiled (Adam 1e-2, MSE) unless ``build`` compiled it, two epochs of batches of 4 on
    ``data`` (so the optimizer holds state to restore: 4 iterations on 8 rows), saved
    through the savedmodel backend. Module-scoped: each module saves each model once and
    hands copies to tests that change the files."""

    def save(build: Callable[[], keras.Model], data: tuple[np.ndarray, np.ndarray]):
        keras.utils.set_random_seed(0)
        model = build()
        if not model.compiled:
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        model.fit(*data, epochs=2, batch_size=4, verbose=0)
        path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("m") / "ckpt")
        return model, path

    return save
