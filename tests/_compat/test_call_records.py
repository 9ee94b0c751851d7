"""``call_records``: what a model was called on, as the SavedModel save reads it to choose
the input forms it tries (``tests/save_backends/savedmodel/save/test_tries_follow_calls.py``
checks the save itself)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import trainer.save_backends  # noqa: F401  (installs the recording)
from trainer._compat import call_records
from trainer.model_state import readiness
from trainer.save_backends.savedmodel.save import tracing


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)


def test_eager_calls_and_fits_traced_calls_are_recorded():
    model = Net()
    model(np.ones((2, 3), "float32"))
    model(tf.SparseTensor([[0, 1]], [2.0], [2, 3]))
    model.compile("sgd", "mse")
    model.fit(np.ones((4, 3), "int64"), np.ones((4, 1)), epochs=1, verbose=0)
    record = call_records.recorded(model)
    assert record.kinds == {"dense", "sparse"}
    assert record.dtypes == {"float32", "int64"}  # int64: fit's traced train step


def test_no_record_where_calls_may_have_been_missed():
    built = Net()
    built.build((None, 3))  # built without a call: earlier calls cannot be ruled out
    built(np.ones((2, 3), "float32"))
    assert call_records.recorded(built) is None


def test_calls_while_paused_are_not_recorded():
    model = Net()
    model(np.ones((2, 3), "float32"))
    with call_records.paused():
        model(np.ones((2, 3), "int32"))
    assert call_records.recorded(model).dtypes == {"float32"}


def test_models_still_run_keras_own_call():
    """The recording sits on ``Layer`` itself: no model looks like it overrides
    ``__call__`` (the save traces such models differently)."""
    model = Net()
    assert not readiness.overrides_call(model)
    assert not tracing.converts_before_call(model)
    assert not tracing.converts_before_call(keras.layers.Dense(1))
    assert tracing.converts_before_call(keras.layers.Rescaling(0.5))


def test_a_copy_shares_the_models_record_or_has_none():
    model, copy = Net(), Net()
    model(np.ones((2, 3), "float32"))
    copy(np.ones((2, 3), "float32"))
    call_records.share(model, copy)
    model(tf.SparseTensor([[0, 1]], [2.0], [2, 3]))  # later calls of the model count
    assert call_records.recorded(copy).kinds == {"dense", "sparse"}
    uncalled, other = Net(), Net()
    other(np.ones((2, 3), "float32"))
    call_records.share(uncalled, other)
    assert call_records.recorded(other) is None
