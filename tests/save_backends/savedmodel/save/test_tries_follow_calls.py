"""The first save of a subclassed model tries only the input forms the model was called on.

Before: the save traced every subclassed model on the sparse and ragged forms of its
inputs (and models of converting layers on four integer widths), whatever it had been
called on, and kept every form the model's code ran on: a Dense MLP only ever called on
dense float32 tensors was traced three times over and stored sparse and ragged functions
(the first save of such a model took about three times as long; a revival test module
twice as long). Now the calls are recorded (``trainer._compat.call_records``) and the save
tries sparse, ragged or 8/16-bit integer forms only where the model was called on them;
a model without a record (built, never called) is still tried on every form.

Checked on what the save really traces and stores, not on time: a layer inside the model
notes every input its ``call`` receives while the save traces, and the saved root's
``call_infer`` lists the input signatures it was traced with.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.noting import DenseNet, noting
from trainer.save_backends import get_backend

SPARSE = tf.SparseTensor([[0, 0], [1, 2], [2, 3]], [1.0, 2.0, -3.0], [3, 4])
CALLS = {
    "dense_float32": [np.ones((3, 4), "float32")],
    "dense_then_sparse": [np.ones((3, 4), "float32"), SPARSE],
    "built_never_called": [],  # no record of its calls: every form is tried
}


def _saved(case: str, tmp_path_factory) -> tuple[set, list[str]]:
    """(what the inner layer ran on during the save, the root's traced signatures)."""
    model = DenseNet(name=case)
    for data in CALLS[case]:
        model(data)
    if not CALLS[case]:
        model.build((None, 4))
    with noting() as noted:
        path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp(case) / "c")
    root = tf.saved_model.load(str(path))
    traced = root.layer_nodes[0].call_infer.concrete_functions
    kinds = sorted(
        type(spec).__name__
        for function in traced
        for spec in tf.nest.flatten(function.structured_input_signature)
    )
    return noted, kinds


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    return {case: _saved(case, tmp_path_factory) for case in CALLS}


def test_a_model_called_on_dense_floats_is_traced_on_dense_floats_only(saves):
    noted, kinds = saves["dense_float32"]
    assert noted == {("SymbolicTensor", "float32")}  # no sparse, ragged or integer try
    assert kinds == ["TensorSpec"]


def test_a_model_also_called_on_sparse_is_traced_on_sparse_not_ragged(saves):
    noted, kinds = saves["dense_then_sparse"]
    assert ("SparseTensor", "float32") in noted
    assert not any(kind == "RaggedTensor" for kind, _ in noted)
    assert kinds == ["SparseTensorSpec", "TensorSpec"]


def test_a_model_without_a_record_of_its_calls_is_still_tried_on_every_form(saves):
    noted, kinds = saves["built_never_called"]
    assert {kind for kind, _ in noted} == {"SymbolicTensor", "SparseTensor", "RaggedTensor"}
    assert kinds == ["RaggedTensorSpec", "SparseTensorSpec", "TensorSpec"]
