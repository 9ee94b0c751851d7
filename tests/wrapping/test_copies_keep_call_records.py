"""The copies ``wrap_model`` and ``unwrap_model`` make keep the record of what the
original model was called on (``trainer._compat.call_records``).

Before: a copy is rebuilt from the model's config and built before any call, so it had no
record, and the first SavedModel save of a subclassed copy (``wrap_model`` matching
nothing inside it, or the model ``unwrap_model`` gives back for export) tried every input
form: sparse and ragged throwaway traces of a model only ever called on dense floats.
Checked on what the save really traces (``tests.helpers.noting``), not on time.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.noting import DenseNet, noting
from trainer.save_backends import get_backend
from trainer.wrapping import unwrap_model, wrap_model
from trainer.wrapping.pruning import PruneLowMagnitude

DENSE = np.ones((3, 4), "float32")
SPARSE = tf.SparseTensor([[0, 0], [1, 2], [2, 3]], [1.0, 2.0, -3.0], [3, 4])


def _noted_by_save(model: keras.Model, path) -> set[tuple[str, str]]:
    with noting() as noted:
        get_backend("savedmodel").save(model, path)
    return noted


@pytest.fixture(scope="module")
def original() -> DenseNet:
    model = DenseNet(name="original")
    model(DENSE)
    model(SPARSE)
    return model


def test_a_copy_wrapping_nothing_tries_the_forms_the_original_was_called_on(original, tmp_path):
    copy = wrap_model(original, lambda layer: False, lambda layer: layer)
    assert type(copy) is DenseNet and copy is not original
    noted = _noted_by_save(copy, tmp_path / "copy")
    assert ("SparseTensor", "float32") in noted  # the original's sparse call counts
    assert not any(kind == "RaggedTensor" for kind, _ in noted)  # never called ragged


def test_the_model_unwrapped_for_export_tries_only_the_forms_seen(tmp_path):
    model = DenseNet(name="dense_only")
    model(DENSE)
    wrapped = wrap_model(
        model, lambda layer: isinstance(layer, keras.layers.Dense), PruneLowMagnitude
    )
    wrapped(DENSE)
    export = unwrap_model(wrapped)
    assert type(export) is DenseNet
    assert _noted_by_save(export, tmp_path / "export") == {("SymbolicTensor", "float32")}
