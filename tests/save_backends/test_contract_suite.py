"""Every registered backend passes the shared suite (``trainer.testing.BackendSuite``), run
the way a third-party backend runs it; a newly registered backend gets it free."""

from __future__ import annotations

import importlib

import pytest

from trainer.errors import NotACheckpointError
from trainer.save_backends import (
    available_backends,
    backend_class,
    detect_backend,
    get_backend,
    registry,
)
from trainer.testing import BackendSuite, build_model


def _backend_or_skip(name: str):
    """The backend instance, or a skip if its module has not landed (not an error)."""
    target = available_backends()[name]
    if isinstance(target, str):
        module = target.partition(":")[0]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not module.startswith(error.name):
                raise  # the module exists but one of its own imports is broken: a real error
            pytest.skip(f"backend {name!r}: module {module} is not available yet ({error})")
    return get_backend(name)


BACKENDS = sorted(available_backends())


class TestRegisteredBackends(BackendSuite):
    """The whole suite (every model kind, every safety check) for each registered backend."""

    @pytest.fixture(params=BACKENDS)
    def backend(self, request):
        return _backend_or_skip(request.param)


@pytest.mark.parametrize("name", BACKENDS)
def test_registry_name_matches_class(name):
    backend = _backend_or_skip(name)
    assert backend_class(name) is type(backend)
    assert type(backend).name == name


def test_loads_return_a_loaded_checkpoint_still_importable_by_its_former_name(tmp_path):
    """The loaded result is ``LoadedCheckpoint``, apart from the Keras callback
    ``trainer.callbacks.Checkpoint``; ``trainer.save_backends.Checkpoint`` stays an alias."""
    from trainer import save_backends
    from trainer.callbacks import Checkpoint as CheckpointCallback
    from trainer.save_backends import LoadedCheckpoint, load_checkpoint

    assert save_backends.Checkpoint is LoadedCheckpoint is save_backends.base.Checkpoint
    assert LoadedCheckpoint is not CheckpointCallback
    path = get_backend("h5").save(build_model("sequential"), tmp_path / "ckpt")
    assert type(load_checkpoint(path, compile=False)) is LoadedCheckpoint


GHOST = {"ghost": "trainer.save_backends.ghost:GhostBackend"}  # a backend not landed yet


def test_a_backend_whose_module_is_missing_is_skipped_not_an_error(monkeypatch):
    monkeypatch.setattr(registry, "_registry", {**registry._registry, **GHOST})
    with pytest.raises(pytest.skip.Exception, match="not available yet"):
        _backend_or_skip("ghost")


def test_detection_passes_over_backends_that_cannot_be_imported(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "_registry", {**GHOST, **registry._registry})
    path = get_backend("h5").save(build_model("sequential", compiled=False), tmp_path / "c")
    assert detect_backend(path) is backend_class("h5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="could not be imported: ghost"):
        detect_backend(tmp_path / "empty")


def test_backends_and_their_wrappers_have_a_readable_repr(compose_cfg, caplog):
    """The start-of-training log line showed ``<...H5Backend object at 0x...>`` and
    ``AsyncBackend(<trainer....object at 0x...>)``."""
    import logging

    from trainer import train
    from trainer.checkpointing.wrappers import AsyncBackend
    from trainer.save_backends.h5 import H5Backend
    from trainer.save_backends.savedmodel.backend import SavedModelBackend
    from trainer.training.distribute import ScratchBackend

    assert repr(get_backend("h5")) == "H5Backend()"
    assert repr(H5Backend(compression="gzip")) == "H5Backend(compression='gzip')"
    assert repr(AsyncBackend(SavedModelBackend())) == "AsyncBackend(SavedModelBackend())"
    nested = ScratchBackend(AsyncBackend(SavedModelBackend(reuse_traces=False)))
    assert repr(nested) == "ScratchBackend(AsyncBackend(SavedModelBackend(reuse_traces=False)))"
    assert repr(get_backend("weights")) == "WeightsBackend()"

    with caplog.at_level(logging.INFO, logger="trainer.training.loop"):
        train(compose_cfg("model=mlp", "save=h5", "checkpoint.policy.async_save=true"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training ")]
    assert "; backend AsyncBackend(H5Backend()); " in line and " at 0x" not in line


def test_wrapping_backends_are_save_backends_reading_the_contract_through():
    """``AsyncBackend`` and ``ScratchBackend`` are ``SaveBackend``s: every member of the
    contract they do not change is the inner backend's, not the base class's default (an
    inherited ``suffix`` would be ``""``, an inherited ``load`` would read as no backend)."""
    from trainer.checkpointing.wrappers import AsyncBackend
    from trainer.save_backends import SaveBackend
    from trainer.save_backends.h5 import H5Backend
    from trainer.training.distribute import ScratchBackend

    inner = H5Backend(compression="gzip")
    nested = AsyncBackend(ScratchBackend(inner))
    assert isinstance(nested, SaveBackend) and isinstance(nested.inner, SaveBackend)
    for member in ("name", "suffix", "is_directory", "format_version", "async_by_default"):
        assert getattr(nested, member) == getattr(inner, member), member
    for method in ("load", "can_load", "read_metadata", "checkpoint_path", "write_into"):
        assert getattr(nested, method) == getattr(inner, method), method
    assert nested.compression == "gzip"  # beyond the contract: through __getattr__
    assert nested.checkpoint_path("ckpt").name == "ckpt.h5"
    assert nested.writes_in_background and not ScratchBackend(inner).writes_in_background


def test_the_manager_asks_any_backend_the_same_write_lifecycle(tmp_path):
    """``CheckpointManager`` names no wrapper: it calls ``prepare``, ``submit`` and ``wait``
    of whatever backend it has, so a backend of the user's may answer them too."""
    from trainer.checkpointing import CheckpointManager, CheckpointPolicy
    from trainer.save_backends.h5 import H5Backend

    calls = []

    class Recording(H5Backend):
        def prepare(self, model):
            calls.append("prepare")

        def submit(self, model, job):
            calls.append("submit")
            super().submit(model, job)

        def wait(self):
            calls.append("wait")

    model = build_model("sequential")
    with CheckpointManager(tmp_path, Recording(), CheckpointPolicy(async_save=False)) as m:
        m.prepare(model)
        path = m.save(model)
    assert path.exists() and m.backend.load(path).state.global_step == 0
    assert calls[:3] == ["prepare", "wait", "submit"] and calls[-1] == "wait"
