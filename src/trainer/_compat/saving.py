"""Keras saving internals: the ``.weights.h5`` file built in memory.

``model.save_weights`` accepts only a path ending in ``.weights.h5`` and writes it with
h5py directly, which crashes the process (SIGSEGV on close) when the disk fills up; the
``weights`` backend instead builds the same bytes in memory and writes them with Python's
I/O. Keras has no public API to serialize weights to a buffer, so this uses
``keras.src.saving.saving_lib.H5IOStore`` (which accepts a BytesIO) and the private
``_save_state`` that ``save_weights`` itself calls. Checked against Keras 3.15.1;
``tests/_compat/test_saving.py`` compares the result with ``model.save_weights`` byte for byte in
content (same datasets and values).
"""

from __future__ import annotations

import io

import keras


def keras_weights_file_bytes(model: keras.Model) -> memoryview:
    """The content ``model.save_weights("x.weights.h5")`` would write, as bytes."""
    from keras.src.saving import saving_lib

    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    try:
        saving_lib._save_state(
            model,
            weights_store=store,
            assets_store=None,
            inner_path="",
            visited_saveables=set(),
        )
    finally:
        store.close()
    return buffer.getbuffer()
