"""The custom backend of docs/how-to/writing-a-backend.md (tests/example_backend/mybackend.py)
works end to end."""

from __future__ import annotations

import hydra
import numpy as np
import pytest

from tests.helpers.paths import ROOT
from trainer.save_backends import get_backend, load_checkpoint, register_backend, registry
from trainer.state import TrainingState
from trainer.testing import BackendSuite, build_model, suite_data, train

EXAMPLE_DIR = ROOT / "tests" / "example_backend"


@pytest.fixture
def example_importable(monkeypatch):
    """``mybackend`` importable as a user's module would be; the registry restored after."""
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


class TestExampleBackendThroughTheRegistry(BackendSuite):
    """The shared suite, run exactly as docs/how-to/writing-a-backend.md tells a third-party
    backend to."""

    # The nested-custom-layer model is enough here; test_contract_suite.py runs all three kinds.
    model_kinds = ("functional",)

    @pytest.fixture
    def backend(self, example_importable):
        register_backend("npz", "mybackend:NpzBackend")
        backend = get_backend("npz")
        assert type(backend).__module__ == "mybackend"
        return backend


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
    """``python train.py save._target_=mybackend.NpzBackend`` as
    docs/how-to/writing-a-backend.md shows it."""
    from trainer import train as run_training

    cfg = compose_cfg("model=mlp", "save._target_=mybackend.NpzBackend")
    metrics = run_training(cfg)
    assert metrics
    saved = sorted((tmp_path / "run" / "checkpoints").glob("*.npz"))
    assert len(saved) == cfg.trainer.epochs
    register_backend("npz", "mybackend:NpzBackend")
    assert load_checkpoint(saved[-1]).state.epoch == cfg.trainer.epochs


def test_a_read_written_before_safe_mode_still_loads_for_one_release(example_importable, tmp_path):
    """``safe_mode`` is an argument of every ``_read`` now; a third-party ``_read`` without it
    (the contract before) is called without it, with a DeprecationWarning, whatever the
    caller's ``safe_mode``: such a backend has no stored code to allow."""
    from mybackend import NpzBackend

    class OldNpz(NpzBackend):
        def _read(self, path, *, custom_objects, compile):
            return super()._read(path, custom_objects=custom_objects, compile=compile)

    model = build_model("functional")
    path = OldNpz().save(model, tmp_path / "old")
    for safe_mode in (True, False):
        with pytest.warns(DeprecationWarning, match=r"OldNpz._read takes no safe_mode"):
            loaded = OldNpz().load(path, safe_mode=safe_mode)
        assert loaded.metadata["backend"] == "npz"
    with pytest.raises(TypeError):  # other unknown options are still refused
        OldNpz().load(path, model=model)
