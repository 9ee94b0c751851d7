"""The round-trip contract every save backend must meet: ``BackendSuite`` and its checks.

``BackendSuite`` is a pytest test class; subclass it in a test module and give it a ``backend``
fixture returning the ``SaveBackend`` instance under test. Each ``check_*`` function is one
part of the contract, callable on its own; ``check_backend`` runs all of them in turn.

Everything runs on CPU with op determinism on, so "identical" means bitwise identical.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import ClassVar

import keras
import numpy as np
import pytest

from trainer.errors import ModelNotReadyError, NotACheckpointError, TrainerError
from trainer.model_state.trainable import optimizer_built_for
from trainer.save_backends import (
    SaveBackend,
    available_backends,
    detect_backend,
    load_checkpoint,
)
from trainer.state import TrainingState
from trainer.storage.atomic import clean_stale_temporaries, is_temporary, temporary_sibling
from trainer.testing.suite_models import (
    BATCH,
    MODEL_KINDS,
    SEED,
    SuiteSubclassed,
    all_values,
    assert_bitwise_equal,
    build_model,
    outputs,
    suite_data,
    train,
)


# ------------------------------------------------------------------------- checks
def check_round_trip(backend: SaveBackend, directory: Path, kind: str) -> None:
    """Save a trained ``kind`` model, load it, and require it to be the same model. The
    loads name ``safe_mode`` (``True``, the default): every backend's ``load`` declares it."""
    model = build_model(kind)
    train(model, kind, epochs=2)
    x, y = suite_data(kind)
    state = TrainingState(
        epoch=2, global_step=8, seed=SEED, metrics={"loss": 0.25}, extra={"suite": [1, 2]}
    )
    run_config = {"model": {"name": kind, "units": 12}, "trainer": {"epochs": 2}}
    path = backend.save(model, Path(directory) / f"ckpt-{kind}", state=state, metadata=run_config)
    assert path.exists() and not is_temporary(path), f"{backend.name} did not publish {path}"
    assert type(backend).can_load(path), f"{backend.name}.can_load rejects its own checkpoint"

    checkpoint = backend.load(path, safe_mode=True)
    loaded = checkpoint.model
    assert checkpoint.path == path
    assert checkpoint.state == state
    assert checkpoint.metadata["backend"] == backend.name
    assert checkpoint.metadata["format_version"] == backend.format_version
    assert checkpoint.metadata["keras_version"] == keras.__version__
    for key, value in run_config.items():
        assert checkpoint.metadata[key] == value, f"metadata[{key!r}] did not round-trip"

    np.testing.assert_array_equal(outputs(model, x), outputs(loaded, x))
    assert loaded.compiled and loaded.optimizer is not None, "model must come back compiled"
    assert type(loaded.optimizer) is type(model.optimizer)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 8
    assert_bitwise_equal(all_values(model), all_values(loaded), f"{kind} variables after load")
    expected = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert loaded.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True) == expected

    if available_backends().get(backend.name) is type(backend):
        assert detect_backend(path) is type(backend)
        detected = load_checkpoint(path, safe_mode=True)
        assert detected.state == state
        assert_bitwise_equal(all_values(loaded), all_values(detected.model), "auto-detected")

    # Continuing from the checkpoint is continuing from the model: Dropout masks, optimizer
    # slots, iteration count and learning-rate schedule position all came back.
    train(model, kind, epochs=1)
    train(loaded, kind, epochs=1)
    assert int(loaded.optimizer.iterations) == 12
    assert_bitwise_equal(all_values(model), all_values(loaded), f"{kind} after more training")


def check_layer_frozen_after_first_step(backend: SaveBackend, directory: Path) -> None:
    """A layer frozen or unfrozen after the optimizer was built (fine-tuning: change
    ``trainable``, then ``compile`` with the same optimizer) leaves the optimizer's slots
    as they were. The load must build the optimizer for the same variables, with the same
    values, and train on alike. Built for the trainable variables it finds instead, it gets
    another count of slots or, where the count and shapes agree, slots on the wrong
    variables without a word."""
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="first"),
            keras.layers.Dense(4, name="second"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    x = np.random.default_rng(SEED).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    fit = {"batch_size": 8, "epochs": 1, "shuffle": False, "verbose": 0}
    first, second = model.get_layer("first"), model.get_layer("second")
    first.trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, **fit)  # the optimizer is built for "second" and "head"
    first.trainable, second.trainable = True, False  # as many variables, of the same shapes
    for step in ("swapped", "subset"):
        if step == "subset":  # both frozen: the optimizer trains "head" alone
            first.trainable = False
            model.compile(optimizer=model.optimizer, loss="mse")
            model.fit(x, y, **fit)
        loaded = backend.load(backend.save(model, Path(directory) / step)).model
        flags = [[layer.trainable for layer in m.layers] for m in (model, loaded)]
        assert flags[0] == flags[1], f"{step}: trainable flags did not round-trip"
        built_for = [optimizer_built_for(m) for m in (model, loaded)]
        assert built_for[0] is not None, "the check no longer builds what it tests"
        assert built_for[0] == built_for[1], f"{step}: optimizer built for other variables"
        assert_bitwise_equal(all_values(model), all_values(loaded), f"{step}: after load")
    model.fit(x, y, **fit)
    loaded.fit(x, y, **fit)
    assert_bitwise_equal(all_values(model), all_values(loaded), "after more training")


def check_weight_decay_exclusions(backend: SaveBackend, directory: Path) -> None:
    """Variables left out of weight decay (``exclude_from_weight_decay``, by name and by
    variable) stay left out after a load: Keras keeps that choice outside the optimizer's
    config, and a load that decays them trains on differently without a word."""
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="first"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_list=[model.layers[0].kernel], var_names=["bias"])
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(SEED).normal(size=(32, 4)).astype("float32")
    fit = {"x": x, "y": x.sum(axis=1, keepdims=True), "batch_size": 8, "verbose": 0}
    model.fit(shuffle=False, **fit)
    loaded = backend.load(backend.save(model, Path(directory) / "no-decay")).model
    assert_bitwise_equal(all_values(model), all_values(loaded), "after load")
    for each in (model, loaded):
        each.fit(shuffle=False, **fit)
    assert_bitwise_equal(all_values(model), all_values(loaded), "after more training")


def check_unbuilt_model_rejected(backend: SaveBackend, directory: Path) -> None:
    """An unbuilt model raises ModelNotReadyError and leaves nothing on disk."""
    directory = Path(directory) / "unbuilt"
    directory.mkdir()
    for model in (keras.Sequential([keras.layers.Dense(2)]), SuiteSubclassed()):
        with pytest.raises(ModelNotReadyError, match="not built"):
            backend.save(model, directory / "never")
    assert list(directory.iterdir()) == []


def check_atomic_replace(backend: SaveBackend, directory: Path) -> None:
    """Saving over a checkpoint replaces it whole; a failed save leaves the old one intact.
    The checkpoint is loaded with ``safe_mode=False`` (the suite wrote it: trusted), which
    every backend's ``load`` accepts, running stored code or having none to run."""
    directory = Path(directory) / "replace"
    model = build_model("sequential")
    x, _ = suite_data("sequential")
    path = backend.save(model, directory / "latest", state=TrainingState(epoch=1))
    train(model, "sequential")
    assert backend.save(model, directory / "latest", state=TrainingState(epoch=2)) == path
    second = outputs(model, x)
    assert [p.name for p in directory.iterdir()] == [path.name], "leftovers after replace"

    write = backend._write

    def crash_after_writing(model, tmp, state, metadata):
        write(model, tmp, state, metadata)
        raise OSError("simulated crash before publication")

    broken = copy.copy(backend)
    broken._write = crash_after_writing
    train(model, "sequential")
    with pytest.raises(OSError, match="simulated crash"):
        broken.save(model, directory / "latest", state=TrainingState(epoch=3))
    assert [p.name for p in directory.iterdir()] == [path.name], "failed save left files"
    checkpoint = backend.load(path, safe_mode=False)
    assert checkpoint.state.epoch == 2
    np.testing.assert_array_equal(outputs(checkpoint.model, x), second)


def check_crash_leftovers_not_loadable(backend: SaveBackend, directory: Path) -> None:
    """What a crashed writer leaves behind is never taken for a checkpoint."""
    directory = Path(directory) / "crash"
    directory.mkdir()
    model = build_model("sequential")
    train(model, "sequential")
    meta = backend.build_metadata(model, TrainingState(epoch=1), {})

    # 1. Complete content in a temporary sibling: the process died before the rename.
    final = backend.checkpoint_path(directory / "crashed")
    tmp = temporary_sibling(final)
    if backend.is_directory:
        tmp.mkdir()
    backend._write(model, tmp, TrainingState(epoch=1), meta)
    assert not final.exists()
    for load in (load_checkpoint, backend.load):
        with pytest.raises(NotACheckpointError):
            load(tmp)

    # 2. A torn copy published under a real name (every file cut in half) is refused.
    torn = backend.checkpoint_path(directory / "torn")
    tmp.rename(torn)
    for file in [torn] if torn.is_file() else [p for p in torn.rglob("*") if p.is_file()]:
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    if type(backend).can_load(torn):
        with pytest.raises(TrainerError):
            backend.load(torn)
    torn.rename(tmp)
    assert clean_stale_temporaries(directory) == [tmp]
    assert list(directory.iterdir()) == []


SAFETY_CHECKS = (
    check_layer_frozen_after_first_step,
    check_weight_decay_exclusions,
    check_unbuilt_model_rejected,
    check_atomic_replace,
    check_crash_leftovers_not_loadable,
)


def check_backend(
    backend: SaveBackend, directory: Path, kinds: tuple[str, ...] = MODEL_KINDS
) -> None:
    """The whole contract for one backend instance; ``directory`` must be empty."""
    for kind in kinds:
        check_round_trip(backend, directory, kind)
    for check in SAFETY_CHECKS:
        check(backend, directory)


class BackendSuite:
    """The contract as a pytest test class: subclass it and provide a ``backend`` fixture.

    ::

        import pytest
        from trainer.testing import BackendSuite

        class TestMyBackend(BackendSuite):
            @pytest.fixture
            def backend(self):
                return MyBackend()

    The fixture may be parametrized (``@pytest.fixture(params=...)``) to run the suite over
    several backends or options, and may depend on other fixtures. ``model_kinds`` restricts
    the round trip to some of ``MODEL_KINDS`` (all three by default). Each test gets its own
    empty ``tmp_path``.

    The class name does not start with ``Test``, so pytest does not collect the suite itself,
    only subclasses named ``Test*``. A subclass that defines ``pytest_generate_tests`` must
    call ``super().pytest_generate_tests(metafunc)``: that is where ``kind`` is parametrized.
    """

    model_kinds: ClassVar[tuple[str, ...]] = MODEL_KINDS

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "kind" in metafunc.fixturenames:
            unknown = [kind for kind in self.model_kinds if kind not in MODEL_KINDS]
            if unknown:
                raise ValueError(
                    f"{type(self).__name__}.model_kinds: unknown kinds {unknown}; valid: "
                    f"{MODEL_KINDS}. Received: {self.model_kinds!r}"
                )
            metafunc.parametrize("kind", self.model_kinds)

    @pytest.fixture
    def backend(self) -> SaveBackend:
        pytest.fail(
            f"{type(self).__name__} must define a `backend` fixture returning the SaveBackend "
            f"instance to test (see trainer.testing.BackendSuite)",
            pytrace=False,
        )

    def test_round_trip(self, backend, kind, tmp_path):
        check_round_trip(_checked(backend), tmp_path, kind)

    def test_layer_frozen_after_first_step(self, backend, tmp_path):
        check_layer_frozen_after_first_step(_checked(backend), tmp_path)

    def test_weight_decay_exclusions(self, backend, tmp_path):
        check_weight_decay_exclusions(_checked(backend), tmp_path)

    def test_unbuilt_model_rejected(self, backend, tmp_path):
        check_unbuilt_model_rejected(_checked(backend), tmp_path)

    def test_atomic_replace(self, backend, tmp_path):
        check_atomic_replace(_checked(backend), tmp_path)

    def test_crash_leftovers_not_loadable(self, backend, tmp_path):
        check_crash_leftovers_not_loadable(_checked(backend), tmp_path)


def _checked(backend: object) -> SaveBackend:
    assert isinstance(backend, SaveBackend), (
        f"the `backend` fixture must return a SaveBackend instance. Received: {backend!r}"
    )
    return backend
