"""Issue 14, defect 11: keras-hub-style backbones revive from their traced functions when
their classes are missing (keras-hub not importable where the checkpoint is loaded).

A keras-hub backbone is a ``keras.Model`` subclass whose ``__init__`` takes its
hyper-parameters, builds a Functional graph over dict inputs and calls
``super().__init__(inputs=..., outputs=...)``; its ``get_config`` returns those
hyper-parameters, not a graph. Its custom layers build their sublayers in ``build``, its
attention layer is called with keyword arguments only (``query=..., value=...``), and its
embedding hands a mask to the layers after it. The classes below imitate that (no
keras-hub needed) and are hidden from Keras' registry at load time, as when the package
defining them is not importable.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops
from keras.src.backend import set_keras_mask  # what keras-hub itself uses

from tests.helpers.savedmodel_zoo import classes_hidden
from trainer.save_backends import get_backend, load_checkpoint

PKG = "bbrev"
register = keras.saving.register_keras_serializable(PKG)
HIDDEN = ["TinyBackbone", "TokenAndPosition", "PositionTable", "Encoder", "KeywordAttention"]
VOCAB, SEQ, HIDDEN_DIM = 50, 16, 16


@register
class PositionTable(layers.Layer):
    """A learned position embedding: one row per position, broadcast over the batch."""

    def __init__(self, sequence_length, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length

    def build(self, shape):
        self.table = self.add_weight(
            shape=(self.sequence_length, shape[-1]), initializer="glorot_uniform", name="table"
        )

    def call(self, inputs, start_index=0):
        length = ops.shape(inputs)[1]
        rows = ops.slice(self.table, (start_index, 0), (length, ops.shape(self.table)[1]))
        return ops.broadcast_to(rows, ops.shape(inputs))

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length}


@register
class TokenAndPosition(layers.Layer):
    """Token plus position embedding; its ``compute_mask`` masks token id 0."""

    def __init__(self, vocabulary_size, sequence_length, hidden_dim, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.sequence_length = sequence_length
        self.hidden_dim = hidden_dim
        self.tokens = layers.Embedding(vocabulary_size, hidden_dim, name="token_embedding")
        self.positions = PositionTable(sequence_length, name="position_embedding")

    def build(self, shape):
        self.tokens.build(shape)
        self.positions.build((*shape, self.hidden_dim))

    def call(self, token_ids):
        embedded = self.tokens(token_ids)
        return embedded + self.positions(embedded)

    def compute_mask(self, token_ids, mask=None):
        return ops.not_equal(token_ids, 0)

    def get_config(self):
        return {
            **super().get_config(),
            "vocabulary_size": self.vocabulary_size,
            "sequence_length": self.sequence_length,
            "hidden_dim": self.hidden_dim,
        }


@register
class KeywordAttention(layers.MultiHeadAttention):
    """Like keras-hub's cached attention: a narrower ``call``, always called by keyword."""

    def call(self, query, value, key=None, attention_mask=None, cache=None, training=None):
        return super().call(query, value, key=key, attention_mask=attention_mask, training=training)


@register
class Encoder(layers.Layer):
    """A post-norm transformer encoder block; attends only to kept, unpadded tokens."""

    def __init__(self, num_heads, intermediate_dim, dropout=0.1, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.supports_masking = True

    def build(self, shape):
        hidden = shape[-1]
        self.attention = KeywordAttention(
            self.num_heads, hidden // self.num_heads, dropout=self.dropout, name="self_attention"
        )
        self.attention.build(shape, shape)
        self.attention_norm = layers.LayerNormalization(name="attention_norm")
        self.attention_norm.build(shape)
        self.attention_dropout = layers.Dropout(self.dropout)
        self.intermediate = layers.Dense(self.intermediate_dim, activation="gelu")
        self.intermediate.build(shape)
        self.output_dense = layers.Dense(hidden)
        self.output_dense.build((*shape[:-1], self.intermediate_dim))
        self.output_norm = layers.LayerNormalization(name="output_norm")
        self.output_norm.build(shape)
        self.output_dropout = layers.Dropout(self.dropout)

    def call(self, inputs, padding_mask=None, mask=None, training=None):
        keep = ops.ones(ops.shape(inputs)[:2], "bool")
        if padding_mask is not None:
            keep = ops.logical_and(keep, ops.cast(padding_mask, "bool"))
        if mask is not None:
            keep = ops.logical_and(keep, mask)
        attention_mask = ops.cast(keep[:, None, :], "int32")
        attended = self.attention(
            query=inputs, value=inputs, attention_mask=attention_mask, training=training
        )
        x = self.attention_norm(inputs + self.attention_dropout(attended, training=training))
        hidden = self.output_dense(self.intermediate(x))
        return self.output_norm(x + self.output_dropout(hidden, training=training))

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "intermediate_dim": self.intermediate_dim,
            "dropout": self.dropout,
        }


@register
class MaskingEmbedding(layers.Layer):
    """Sets its output's mask inside ``call``, as keras-hub's ``TokenAndPositionEmbedding``
    does with ``mask_zero=True`` (it has no ``compute_mask`` of its own)."""

    def __init__(self, vocabulary_size, hidden_dim, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.hidden_dim = hidden_dim
        self.tokens = layers.Embedding(vocabulary_size, hidden_dim, mask_zero=True)

    def build(self, shape):
        self.tokens.build(shape)

    def call(self, token_ids):
        outputs = self.tokens(token_ids) * 2.0
        set_keras_mask(outputs, self.tokens.compute_mask(token_ids))
        return outputs

    def get_config(self):
        return {
            **super().get_config(),
            "vocabulary_size": self.vocabulary_size,
            "hidden_dim": self.hidden_dim,
        }


@register
class TinyBackbone(keras.Model):
    """The backbone: its own ``__init__`` builds the graph, its config is its arguments."""

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        max_sequence_length=SEQ,
        dropout=0.1,
        **kwargs,
    ):
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input((None,), dtype="int32", name="padding_mask")
        embed = TokenAndPosition(
            vocabulary_size, max_sequence_length, hidden_dim, name="embeddings"
        )
        x = layers.LayerNormalization(name="embeddings_layer_norm")(embed(token_ids))
        x = layers.Dropout(dropout, name="embeddings_dropout")(x)
        for i in range(num_layers):
            block = Encoder(num_heads, intermediate_dim, dropout, name=f"transformer_layer_{i}")
            x = block(x, padding_mask=padding_mask)
        pooled = layers.Dense(hidden_dim, activation="tanh", name="pooled_dense")(x[:, 0, :])
        super().__init__(
            inputs={"token_ids": token_ids, "padding_mask": padding_mask},
            outputs={"sequence_output": x, "pooled_output": pooled},
            **kwargs,
        )
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.max_sequence_length = max_sequence_length
        self.dropout = dropout

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "vocabulary_size": self.vocabulary_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
            "max_sequence_length": self.max_sequence_length,
            "dropout": self.dropout,
        }


def _backbone():
    keras.utils.set_random_seed(0)
    return TinyBackbone(VOCAB, 2, 2, HIDDEN_DIM, 32, name="backbone")


def _inputs(seed, padded=True, n=8, length=12):
    """Token ids with some interior zeros (masked by the embedding's ``compute_mask``)
    and, if ``padded``, rows padded with zeros from a row-dependent position."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, length)).astype("int32")
    tokens[:, 0] = 1  # the pooled token is never masked
    padding = np.ones((n, length), "int32")
    if padded:
        for row in range(n):
            padding[row, length - 1 - row % 6 :] = 0
    return {"token_ids": tokens * padding, "padding_mask": padding}


def _targets(model, x, seed=1):
    """Targets shaped like the model's outputs (dict for the backbone)."""
    rng = np.random.default_rng(seed)
    outputs = model(x)
    return tf.nest.map_structure(
        lambda out: rng.normal(size=out.shape).astype("float32") * 0.1, outputs
    )


def _compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    return model


def _fit(model, x, y, epochs=1):
    return model.fit(x, y, epochs=epochs, batch_size=4, verbose=0, shuffle=False)


def _numpy(outputs):
    return tf.nest.map_structure(np.asarray, outputs)


def _assert_close(actual, expected, atol=1e-5):
    tf.nest.assert_same_structure(actual, expected)
    flat = zip(tf.nest.flatten(_numpy(actual)), tf.nest.flatten(_numpy(expected)), strict=True)
    for a, e in flat:
        np.testing.assert_allclose(a, e, atol=atol)


def _save(model, path):
    return get_backend("savedmodel").save(model, path)


def _assert_revived_behaves(original, loaded, tmp_path):
    """Outputs within 1e-5 (with and without padding), dropout in training, gradients to
    every variable, fit lowers the loss, and a second save and load still reproduces it."""
    for padded in (True, False):
        x = _inputs(2, padded=padded)
        _assert_close(loaded(x), original(x))
    x = _inputs(2)
    inference = tf.nest.flatten(_numpy(loaded(x)))[0]
    for model in (original, loaded):  # dropout: training=True differs, in both
        trained = tf.nest.flatten(_numpy(model(x, training=True)))[0]
        assert not np.allclose(trained, inference, atol=1e-4), model.name
    again = [tf.nest.flatten(_numpy(loaded(x, training=True)))[0] for _ in range(2)]
    assert not np.allclose(again[0], again[1], atol=1e-4)  # random, like Dropout
    with tf.GradientTape() as tape:
        total = sum(ops.sum(out) for out in tf.nest.flatten(loaded(x, training=True)))
    grads = tape.gradient(total, loaded.trainable_variables)
    assert len(loaded.trainable_variables) == len(original.trainable_variables)
    missing = [v.path for v, g in zip(loaded.trainable_variables, grads, strict=True) if g is None]
    assert not missing
    losses = _fit(_compiled(loaded), x, _targets(loaded, x), epochs=8).history["loss"]
    assert losses[-1] < losses[0]
    expected = loaded(x)
    again = load_checkpoint(_save(loaded, tmp_path / "again"))
    _assert_close(again.model(x), expected)
    _assert_close(again.model(_inputs(3, padded=False)), loaded(_inputs(3, padded=False)))


def test_backbone_with_its_classes_known_is_rebuilt_bitwise_and_trains_identically(tmp_path):
    model = _backbone()
    x = _inputs(0)
    y = _targets(model, x)
    _fit(_compiled(model), x, y)
    checkpoint = load_checkpoint(_save(model, tmp_path / "ckpt"))
    loaded = checkpoint.model
    assert type(loaded) is TinyBackbone
    assert checkpoint.metadata["revived_from"]["backbone"] == "config"
    for padded in (True, False):
        xs = _inputs(2, padded=padded)
        flat = zip(
            tf.nest.flatten(_numpy(loaded(xs))), tf.nest.flatten(_numpy(model(xs))), strict=True
        )
        for a, e in flat:
            np.testing.assert_array_equal(a, e)
    for m in (model, loaded):  # same weights, optimizer state and dropout seeds
        _fit(m, x, y, epochs=2)
    for a, b in zip(model.variables, loaded.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


@pytest.fixture(scope="module")
def saved_backbone(tmp_path_factory):
    """An untrained backbone and its checkpoint, shared by the class-missing cases."""
    model = _backbone()
    return model, _save(model, tmp_path_factory.mktemp("backbone") / "ckpt")


def test_backbone_with_its_classes_missing_revives_from_traces(tmp_path, saved_backbone):
    model, saved = saved_backbone
    with classes_hidden(HIDDEN, PKG):
        checkpoint = load_checkpoint(saved)
        loaded = checkpoint.model
        how = checkpoint.metadata["revived_from"]
        assert how["backbone"] == "traced"
        assert how["transformer_layer_0"] == how["self_attention"] == "traced"
        assert isinstance(loaded, keras.Model)
        assert type(loaded).__name__ == "TinyBackbone"
        _assert_revived_behaves(model, loaded, tmp_path)


def test_backbone_inside_a_classifier_revives_with_its_classes_missing(tmp_path):
    backbone = _backbone()
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
    }
    pooled = backbone(inputs)["pooled_output"]
    logits = layers.Dense(3, name="head")(layers.Dropout(0.2)(pooled))
    model = keras.Model(inputs, logits, name="classifier")
    saved = _save(model, tmp_path / "ckpt")
    with classes_hidden(HIDDEN, PKG):
        checkpoint = load_checkpoint(saved)
        loaded = checkpoint.model
        how = checkpoint.metadata["revived_from"]
        assert how["classifier"] == "graph"
        assert how["backbone"] == "traced"
        assert type(loaded.get_layer("backbone")).__name__ == "TinyBackbone"
        _assert_revived_behaves(model, loaded, tmp_path)


def test_keyword_only_attention_call_revives_and_saves_again(tmp_path, saved_backbone):
    """A layer called with keyword arguments only (``query=..., value=...``), as keras-hub's
    decoder calls its attention: revived from traces, calling it directly and saving it
    again failed ("missing a required argument: 'inputs'")."""
    model, saved = saved_backbone
    with classes_hidden(HIDDEN, PKG):
        loaded = load_checkpoint(saved).model
        attention = loaded.get_layer("transformer_layer_0").attention
        original = model.get_layer("transformer_layer_0").attention
        assert type(attention).__name__ == "KeywordAttention"
        query = np.random.default_rng(4).normal(size=(2, 5, HIDDEN_DIM)).astype("float32")
        mask = np.ones((2, 1, 5), "int32")  # the shape the encoder passes (and traced)
        mask[:, :, 3:] = 0
        kwargs = {"query": query, "value": query, "attention_mask": mask}
        _assert_close(attention(**kwargs), original(**kwargs))
        _assert_close(attention(**kwargs, training=False), original(**kwargs, training=False))
        x = _inputs(0)
        _assert_close(load_checkpoint(_save(loaded, tmp_path / "again")).model(x), model(x))


def test_mask_set_inside_call_survives_revival(tmp_path):
    """keras-hub's ``TokenAndPositionEmbedding(mask_zero=True)`` attaches its output's mask
    inside ``call``; the encoder after it reads the mask from its input. Revived from
    traces, that mask was lost and the outputs differed (attention to padding)."""
    keras.utils.set_random_seed(0)
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    embedded = MaskingEmbedding(VOCAB, HIDDEN_DIM, name="masking_embedding")(token_ids)
    model = keras.Model(token_ids, Encoder(2, 32, 0.1, name="encoder")(embedded), name="enc")
    x = _inputs(5)["token_ids"]
    expected = model(x)
    saved = _save(model, tmp_path / "ckpt")
    with classes_hidden([*HIDDEN, "MaskingEmbedding"], PKG):
        checkpoint = load_checkpoint(saved)
        assert checkpoint.metadata["revived_from"]["masking_embedding"] == "traced"
        assert checkpoint.metadata["revived_from"]["encoder"] == "traced"
        _assert_close(checkpoint.model(x), expected)
        again = load_checkpoint(_save(checkpoint.model, tmp_path / "again")).model
        _assert_close(again(x), expected)


def test_compat_keras_mask_helpers_round_trip():
    """``set_keras_mask`` / ``keras_mask`` (``trainer._compat.keras``) attach and read the
    mask Keras itself reads, on eager tensors and inside a ``tf.function``."""
    from trainer._compat import keras as keras_compat

    mask = tf.constant([[True, False]])
    eager = tf.ones((1, 2))
    keras_compat.set_keras_mask(eager, mask)
    assert keras_compat.keras_mask(eager) is mask
    assert keras_compat.keras_mask(tf.ones((1, 2))) is None

    @tf.function
    def attached(x, m):
        keras_compat.set_keras_mask(x, m)
        return tf.constant(keras_compat.keras_mask(x) is m)

    assert bool(attached(tf.ones((1, 2)), mask))
