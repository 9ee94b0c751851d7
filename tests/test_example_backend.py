"""The README's custom backend (tests/example_backend/mybackend.py) works end to end."""

from __future__ import annotations

from pathlib import Path

import hydra
import numpy as np
import pytest
from backend_suite import build_model, check_backend, suite_data, train

from trainer.save_backends import get_backend, load_checkpoint, register_backend, registry
from trainer.state import TrainingState

EXAMPLE_DIR = Path(__file__).parent / "example_backend"


@pytest.fixture
def example_importable(monkeypatch):
    """``mybackend`` importable as a user's module would be; the registry restored after."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_example_backend_passes_the_shared_suite_through_the_registry(example_importable, tmp_path):
    register_backend("npz", "mybackend:NpzBackend")
    backend = get_backend("npz")
    assert type(backend).__module__ == "mybackend"
    # The nested-custom-layer model is enough here; test_backends.py runs all three kinds.
    check_backend(backend, tmp_path, kinds=("functional",))


def test_example_backend_from_a_hydra_target(example_importable, tmp_path):
    backend = hydra.utils.instantiate({"_target_": "mybackend.NpzBackend"})
    model = build_model("functional")
    train(model, "functional")
    x, _ = suite_data("functional")
    path = backend.save(model, tmp_path / "epoch-001", state=TrainingState(epoch=1))
    assert path == tmp_path / "epoch-001.npz"
    with np.load(path, allow_pickle=False) as data:  # nothing in it needs pickle
        assert all(data[key].dtype != object for key in data.files)

    checkpoint = backend.load(path)
    assert checkpoint.state.epoch == 1 and checkpoint.metadata["backend"] == "npz"
    np.testing.assert_array_equal(model.predict(x, verbose=0), checkpoint.model.predict(x))

    register_backend("npz", type(backend))  # registered names take part in detection
    assert load_checkpoint(path).metadata["backend"] == "npz"


@pytest.mark.slow
def test_train_py_runs_with_the_example_backend(example_importable, compose_cfg, tmp_path):
    """``python train.py save._target_=mybackend.NpzBackend`` as the README shows it."""
    from trainer import train as run_training

    cfg = compose_cfg("model=mlp", "save._target_=mybackend.NpzBackend")
    metrics = run_training(cfg)
    assert metrics
    saved = sorted((tmp_path / "run" / "checkpoints").glob("*.npz"))
    assert len(saved) == cfg.trainer.epochs
    register_backend("npz", "mybackend:NpzBackend")
    assert load_checkpoint(saved[-1]).state.epoch == cfg.trainer.epochs
