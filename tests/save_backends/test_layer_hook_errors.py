"""An exception raised in a layer's own save/load hook (``save_own_variables``,
``load_own_variables``, ``save_assets``, ``load_assets``) reaches the caller, through
every backend: as itself, or as a ``TrainerError`` whose ``__cause__`` is that very
exception and whose message carries its text. A save that fails this way leaves no
checkpoint behind that looks complete, and the checkpoint it was replacing intact.

Keras's own ``saving_lib_test`` checks the same (``test_{save,load}_model_exception_raised``)
for its ``.keras`` zip; ``tests/save_backends/test_keras_peer_suites.py`` runs those
through trainer. Here the exception is not a ``ValueError`` (Keras's ``load_weights``
turns whatever a hook raised into a ``ValueError`` holding only its text, which the
weights backend used to hand on, the original lost).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from tests.helpers.noting import AroundDense
from trainer.errors import TrainerError
from trainer.save_backends import backend_class, get_backend

BACKENDS = ("savedmodel", "h5", "weights")
X = np.linspace(-1.0, 1.0, 12, dtype="float32").reshape(4, 3)


class HookFailure(Exception):
    """Deliberately no ValueError: the type must survive, not only the text."""


@keras.saving.register_keras_serializable(package="test_layer_hook_errors")
class Hooked(AroundDense):
    """A Dense inside, a vocabulary-like asset; ``Hooked.failing`` names the hook that
    raises (and ``Hooked.raised`` keeps the exception it raised, to compare identity)."""

    failing: str | None = None
    raised: BaseException | None = None

    def _maybe_fail(self, hook):
        if Hooked.failing == hook:
            Hooked.raised = HookFailure(f"{hook} of {self.name} broke on purpose")
            raise Hooked.raised

    def save_own_variables(self, store):
        self._maybe_fail("save_own_variables")
        super().save_own_variables(store)

    def load_own_variables(self, store):
        self._maybe_fail("load_own_variables")
        super().load_own_variables(store)

    def save_assets(self, inner_path):
        self._maybe_fail("save_assets")
        with open(os.path.join(inner_path, "note.txt"), "w") as handle:
            handle.write("kept")

    def load_assets(self, inner_path):
        self._maybe_fail("load_assets")


def hooked_model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), Hooked(name="hooked")])
    model(X)
    return model


@pytest.fixture(autouse=True)
def disarmed():
    Hooked.failing = Hooked.raised = None
    yield
    Hooked.failing = Hooked.raised = None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One good checkpoint per backend."""
    model = hooked_model()
    root = tmp_path_factory.mktemp("hook_errors")
    return {b: get_backend(b).save(model, root / b / "ckpt") for b in BACKENDS}


def assert_reaches_caller(error: BaseException) -> None:
    """``error`` is the hook's exception, or a TrainerError caused by it, naming it."""
    original = Hooked.raised
    assert original is not None, "the hook never ran"
    if error is original:
        return
    assert isinstance(error, TrainerError), f"{type(error).__name__}: {error}"
    assert error.__cause__ is original, f"cause {error.__cause__!r} is not {original!r}"
    assert str(original) in str(error), str(error)


@pytest.mark.parametrize("hook", ["load_own_variables", "load_assets"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exception_in_a_load_hook_reaches_the_caller(backend, hook, saved):
    Hooked.failing = hook
    with pytest.raises(Exception) as caught:
        get_backend(backend).load(saved[backend], compile=False)
    assert_reaches_caller(caught.value)


@pytest.mark.parametrize("hook", ["save_own_variables", "save_assets"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_save_keeps_the_checkpoint_it_would_replace(backend, hook, tmp_path):
    first = hooked_model()
    written = get_backend(backend).save(first, tmp_path / "ckpt")
    before = sorted(os.listdir(tmp_path))

    Hooked.failing = hook
    with pytest.raises(Exception) as caught:
        get_backend(backend).save(hooked_model(), tmp_path / "ckpt")  # other weights
    assert_reaches_caller(caught.value)
    Hooked.failing = None

    # Nothing half-written beside it, and the previous checkpoint loads as it was.
    assert sorted(os.listdir(tmp_path)) == before
    reloaded = get_backend(backend).load(written, compile=False).model
    assert np.allclose(keras.ops.convert_to_numpy(reloaded(X)), first(X))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_first_save_leaves_nothing_that_looks_like_a_checkpoint(backend, tmp_path):
    Hooked.failing = "save_own_variables"
    with pytest.raises(Exception) as caught:
        get_backend(backend).save(hooked_model(), tmp_path / "ckpt")
    assert_reaches_caller(caught.value)
    cls = backend_class(backend)
    assert [p for p in tmp_path.iterdir() if cls.can_load(p)] == []
    assert os.listdir(tmp_path) == []
