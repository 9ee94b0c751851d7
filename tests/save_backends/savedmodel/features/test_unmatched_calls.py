"""A revived layer called on inputs none of its traces takes says what differs, what the
traces take, and keeps TensorFlow's error.

Before: every refused call got one message about "the kind of tensors (dense, ragged or
sparse, same rank and dtype)" and subclassed-model dtype advice, whatever differed (a
wrong width too), and Keras' call wrapper dropped TensorFlow's error: the real cause never
reached the user.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from tests.helpers import savedmodel_zoo as zoo
from trainer.errors import RevivedCallError
from trainer.save_backends import get_backend, load_checkpoint


@keras.saving.register_keras_serializable(zoo.PKG)
class WidthThree(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, name="dense")

    def call(self, x):
        return self.dense(x)


@pytest.fixture(scope="module")
def revived(tmp_path_factory):
    model = WidthThree(name="width_three")
    model(np.ones((2, 3), "float32"))
    path = get_backend("savedmodel").save(model, tmp_path_factory.mktemp("ckpt") / "c")
    with zoo.classes_hidden(["WidthThree"]):
        loaded = load_checkpoint(path)
    assert loaded.metadata["revived_from"]["width_three"] == "traced"
    return loaded.model


TRACE = r"trace 1 takes \[dense float32 \(None, 3\)\]: "
TF = r"TensorFlow's error: ValueError: Could not find matching concrete function"


@pytest.mark.parametrize(
    ("x", "difference"),
    [
        (np.ones((2, 5), "float32"), r"input 0 has shape \(2, 5\), where it takes \(None, 3\)"),
        (np.ones((2, 3, 1), "float32"), r"input 0 has shape \(2, 3, 1\), where it takes .*rank"),
        (np.ones((2, 3), "int32"), r"input 0 is int32, where it takes float32"),
    ],
    ids=["width", "rank", "dtype"],
)
def test_a_refused_call_names_the_difference_and_tensorflows_error(revived, x, difference):
    with pytest.raises(RevivedCallError, match=TRACE + difference + ".*" + TF) as caught:
        revived(x)
    message = str(caught.value)
    assert message.rstrip().endswith("kwargs={}") and "Received: args=" in message
    assert ("InputSpec(dtype=" in message) == (x.dtype != np.float32)  # dtype advice only
    cause = caught.value.tensorflow_error
    assert isinstance(cause, ValueError) and not isinstance(cause, RevivedCallError)


def test_the_tensorflow_error_is_the_chained_cause(revived):
    with pytest.raises(RevivedCallError) as caught:
        revived.call(np.ones((2, 5), "float32"))  # without Keras' wrapper, which drops causes
    assert caught.value.__cause__ is caught.value.tensorflow_error
    np.testing.assert_allclose(  # and the inputs it takes still work
        revived(np.ones((4, 3), "float32")).shape, (4, 2)
    )
