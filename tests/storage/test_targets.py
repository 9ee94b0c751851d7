"""Saving never deletes a user's data: only a checkpoint trainer wrote may be replaced."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.errors import SaveError, TrainerError
from trainer.save_backends import get_backend, load_checkpoint

BACKENDS = ("savedmodel", "h5", "weights")


def small_model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_refuses_an_existing_directory_that_is_not_a_checkpoint(tmp_path, backend):
    target = tmp_path / "my_data"
    target.mkdir()
    (target / "precious.txt").write_text("do not delete")
    path = get_backend(backend).checkpoint_path(target)
    if path != target:  # a file backend adds its suffix: put the user's file there instead
        path.write_text("do not delete")
    with pytest.raises(SaveError, match=r"not a trainer checkpoint.*Received"):
        get_backend(backend).save(small_model(), target)
    assert (target / "precious.txt").read_text() == "do not delete"
    assert path.exists()
    with pytest.raises(TrainerError):  # still the user's data, not a checkpoint
        load_checkpoint(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_replaces_its_own_checkpoint_and_an_empty_directory(tmp_path, backend):
    model = small_model()
    first = get_backend(backend).save(model, tmp_path / "ckpt")
    model.layers[0].kernel.assign(np.ones((3, 2), "float32"))
    second = get_backend(backend).save(model, tmp_path / "ckpt")
    assert first == second
    loaded = load_checkpoint(second).model
    np.testing.assert_array_equal(loaded.layers[0].kernel.numpy(), np.ones((3, 2)))
    empty = tmp_path / "empty"
    empty.mkdir()
    get_backend(backend).save(model, empty)


def test_save_over_another_backends_checkpoint_is_allowed(tmp_path):
    model = small_model()
    get_backend("savedmodel").save(model, tmp_path / "ckpt")
    get_backend("weights").save(model, tmp_path / "ckpt")
    assert load_checkpoint(tmp_path / "ckpt").metadata["backend"] == "weights"
