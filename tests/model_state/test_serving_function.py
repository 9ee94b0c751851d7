"""The serving function a ``format=keras`` export writes (and ``inspect`` of an h5 or
weights checkpoint describes): every output kept, every positional input taken.

Found by a probe: a Functional model whose two outputs come from one shared layer
(``output_names == ['head', 'head']``) was served with one output, keyed ``head``; a
subclassed ``call(x, y)`` could not be exported (a raw ``TypeError``)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from trainer.exports.exporter import export_serving
from trainer.model_state.serving import model_signatures, serving_function
from trainer.save_backends import get_backend, load_checkpoint


def test_outputs_sharing_a_layer_name_are_all_served(tmp_path):
    keras.utils.set_random_seed(0)
    left, right = keras.Input((3,), name="left"), keras.Input((3,), name="right")
    head = keras.layers.Dense(2, name="head")
    model = keras.Model([left, right], [head(left), head(right)])
    xa, xb = np.ones((1, 3), "float32"), -np.ones((1, 3), "float32")
    expected = [o.numpy() for o in model([xa, xb])]
    path = export_serving(model, tmp_path / "export", format="keras")
    served = tf.saved_model.load(str(path)).signatures["serving_default"](
        left=tf.constant(xa), right=tf.constant(xb)
    )
    assert sorted(served) == ["output_0", "output_1"]
    np.testing.assert_array_equal(served["output_0"].numpy(), expected[0])
    np.testing.assert_array_equal(served["output_1"].numpy(), expected[1])


class TwoArguments(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(3)
        self.b = keras.layers.Dense(3)

    def build(self, x_shape, y_shape):
        self.a.build(x_shape)
        self.b.build(y_shape)

    def call(self, x, y):
        return self.a(x) - 3 * self.b(y)


def test_a_call_taking_two_positional_inputs_is_exported_and_described(tmp_path):
    model = TwoArguments()
    x, y = np.ones((2, 4), "float32"), np.full((2, 5), 2.0, "float32")
    expected = model(x, y).numpy()
    path = export_serving(model, tmp_path / "export", format="keras")
    function = tf.saved_model.load(str(path)).signatures["serving_default"]
    (served,) = function(inputs=tf.constant(x), inputs_1=tf.constant(y)).values()
    np.testing.assert_allclose(served.numpy(), expected, atol=1e-6)
    described = model_signatures(model)["serving_default"]["inputs"]
    assert [spec["shape"] for spec in described.values()] == [[None, 4], [None, 5]]


@keras.saving.register_keras_serializable("test_serving_function")
class DeclaredIds(keras.Model):
    """A subclassed model on int32 ids that says so in its ``input_spec``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(10, 3)
        self.head = keras.layers.Dense(2)
        self.input_spec = keras.InputSpec(dtype="int32", ndim=2)

    def call(self, ids):
        return self.head(keras.ops.mean(self.embed(ids), axis=1))


def test_a_subclassed_model_declaring_int32_ids_is_served_taking_them(tmp_path):
    """Keras types a subclassed model's inputs with its float compute dtype: the serving
    function (``inspect`` of an h5 or weights checkpoint, the TensorBoard graph) was traced
    on float32, which the model's own int32 ``input_spec`` refused with a raw
    ``ValueError`` (issue 38 item 3)."""
    keras.utils.set_random_seed(0)
    model = DeclaredIds()
    ids = np.array([[1, 2, 3], [4, 5, 0]], "int32")
    expected = model(ids).numpy()
    loaded = load_checkpoint(get_backend("h5").save(model, tmp_path / "ckpt.h5")).model
    inputs = model_signatures(loaded)["serving_default"]["inputs"]
    assert inputs == {"inputs": {"shape": [None, 3], "dtype": "int32"}}
    served = serving_function(loaded)
    np.testing.assert_allclose(served(tf.constant(ids)).numpy(), expected, atol=1e-6)
