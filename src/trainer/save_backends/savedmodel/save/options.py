"""The ``tf.saved_model.SaveOptions`` of a save, in one table.

The functions are traced inside the context of the default options (``object_graph``)
and saved with whichever the save needs (``trace_cache``); both read them here, so the
two cannot drift apart. ``tf.function``'s cache key reads only the variable policy of the
options, which is the same in every entry: a save with other options traces nothing again.
"""

from __future__ import annotations

import tensorflow as tf

# No SaverDef from TensorFlow: trainer writes its own (``saver_def``), TensorFlow's traced
# save and restore functions over every variable were a quarter of a first save.
# No custom gradients either, unless a layer's traces use one (``save_options``): looking
# for them walks every op of every saved function, for nothing in most models.
# Keyed by (tf_saver, gradients).
_TABLE = {
    (False, False): tf.saved_model.SaveOptions(
        experimental_custom_gradients=False, experimental_skip_saver=True
    ),
    # Where trainer's SaverDef cannot be written (checkpoint entries that are not plain
    # variables), TensorFlow's.
    (True, False): tf.saved_model.SaveOptions(experimental_custom_gradients=False),
    # A model whose traces use tf.custom_gradient saves their gradient functions too.
    (False, True): tf.saved_model.SaveOptions(
        experimental_custom_gradients=True, experimental_skip_saver=True
    ),
    (True, True): tf.saved_model.SaveOptions(experimental_custom_gradients=True),
}

# The options the functions are traced under (and most models are saved with).
SAVE_OPTIONS = _TABLE[False, False]


def save_options(*, tf_saver: bool, gradients: bool) -> tf.saved_model.SaveOptions:
    """The options of the save: with TensorFlow's SaverDef or not (``tf_saver``), and with
    the traced gradient functions of ``tf.custom_gradient`` calls or not (``gradients``;
    see ``features.python_gradients``)."""
    return _TABLE[bool(tf_saver), bool(gradients)]
