"""Issue 17: trainer writes the ``variables/`` tensor bundle of a repeat save itself (around
the page cache). Its files must be the bytes TensorFlow's ``SaveV2`` writes for the same
tensors, so every reader of TensorFlow's checkpoints reads them as its own."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import tensorflow as tf

from trainer.save_backends.savedmodel.bundle import tensor_bundle
from trainer.storage import direct_io


def _tensors(extra_keys: int = 0) -> dict[str, tf.Tensor]:
    rng = np.random.default_rng(0)
    tensors = {
        "_CHECKPOINTABLE_OBJECT_GRAPH": tf.constant(b"\x00graph" * 60),
        "a/.ATTRIBUTES/VARIABLE_VALUE": tf.constant(rng.normal(size=(3, 4)), tf.float32),
        "b/.ATTRIBUTES/VARIABLE_VALUE": tf.constant(7, tf.int64),
        "empty": tf.zeros((0, 3), tf.float32),
        "strings": tf.constant([b"x", b"", "\u00e9t\u00e9".encode(), b"long" * 70]),
        "\u00e9l\u00e8ve/kernel": tf.constant([1.5], tf.float64),  # keys sort as UTF-8
    }
    for number, dtype in enumerate(sorted(tensor_bundle.SUPPORTED - {tf.string}, key=str)):
        values = tf.constant(rng.normal(size=(2, 5)) * 3, tf.float64)
        tensors[f"dtype_{number}_{dtype.name}"] = tf.cast(values, dtype)
    for number in range(extra_keys):  # an index of several data blocks
        tensors[f"layer_{number:05d}/kernel/.ATTRIBUTES/VARIABLE_VALUE"] = tf.constant(
            rng.normal(size=(3,)), tf.float32
        )
    return tensors


def _write_both(tmp_path, tensors: dict[str, tf.Tensor]):
    names = sorted(tensors)
    theirs = str(tmp_path / "theirs" / "variables")
    tf.raw_ops.SaveV2(
        prefix=theirs,
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tensors[n] for n in names],
    )
    ours = tmp_path / "ours"
    ours.mkdir()
    entries = [(n, tensors[n].dtype, tensors[n].numpy) for n in reversed(names)]
    written = tensor_bundle.write_bundle(str(ours / "variables"), entries)
    return theirs, str(ours / "variables"), written


@pytest.mark.parametrize("extra_keys", [0, 6000])
def test_the_bundle_is_byte_for_byte_what_save_v2_writes(tmp_path, extra_keys):
    tensors = _tensors(extra_keys)
    theirs, ours, written = _write_both(tmp_path, tensors)
    for suffix in (tensor_bundle.INDEX_SUFFIX, tensor_bundle.DATA_SUFFIX):
        with open(theirs + suffix, "rb") as a, open(ours + suffix, "rb") as b:
            assert a.read() == b.read(), suffix
    if extra_keys:  # the index really spans several blocks of the table
        assert os.path.getsize(ours + tensor_bundle.INDEX_SUFFIX) > tensor_bundle.BLOCK_SIZE
    with open(ours + tensor_bundle.DATA_SUFFIX, "rb") as handle:
        data = handle.read()
    assert (written.data_size, written.data_sha256) == (len(data), hashlib.sha256(data).hexdigest())
    with open(ours + tensor_bundle.INDEX_SUFFIX, "rb") as handle:
        assert handle.read() == written.index
    reader = tf.train.load_checkpoint(ours)
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader.get_tensor(name), value.numpy(), err_msg=name)


def test_a_data_file_larger_than_the_staging_chunks_is_exact(tmp_path):
    """Several staging chunks, a tensor straddling two of them, a length that is not a
    multiple of the direct-I/O alignment: the file and its digest are still exact."""
    rng = np.random.default_rng(1)
    count = direct_io.CHUNK // 4 + 1234  # float32 elements: more than one chunk
    tensors = {
        "big": tf.constant(rng.normal(size=(count,)), tf.float32),
        "bigger": tf.constant(rng.normal(size=(2 * count + 3,)), tf.float32),
        "odd": tf.constant([1, 2, 3], tf.int8),
    }
    theirs, ours, written = _write_both(tmp_path, tensors)
    with open(theirs + tensor_bundle.DATA_SUFFIX, "rb") as a:
        expected = a.read()
    assert written.data_size == len(expected)
    with open(ours + tensor_bundle.DATA_SUFFIX, "rb") as b:
        assert b.read() == expected
    assert written.data_sha256 == hashlib.sha256(expected).hexdigest()


def test_buffered_writes_give_the_same_file(tmp_path, monkeypatch):
    """``TRAINER_BUFFERED_WRITES=1`` (a filesystem that misbehaves with O_DIRECT) turns the
    bypass off; the bytes are the same."""
    monkeypatch.setenv(direct_io.BUFFERED_ENV, "1")
    target = tmp_path / "file"
    streamed = direct_io.StreamedFile(target)
    assert not streamed.direct
    streamed.write(b"abc" * 5000)
    assert streamed.close()[0] == 15000
    assert target.read_bytes() == b"abc" * 5000


def test_direct_io_is_used_where_the_filesystem_allows_it(tmp_path):
    """On the test machine's filesystem the bypass is really taken (else this change
    measures nothing); a filesystem refusing it falls back, which the test above covers."""
    streamed = direct_io.StreamedFile(tmp_path / "file")
    try:
        if not direct_io.direct_wanted():
            pytest.skip("no O_DIRECT on this platform")
        if not streamed.direct:
            pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
        streamed.write(b"x" * 10)
    finally:
        size, _ = streamed.close()
    assert size == 10 and (tmp_path / "file").read_bytes() == b"x" * 10
