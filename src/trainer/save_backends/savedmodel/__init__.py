"""``savedmodel``: a real TensorFlow SavedModel that also revives as a trainable Keras model.

Modules, in the order a save and a load go through them:

- ``backend``: :class:`SavedModelBackend`, the ``SaveBackend`` (``save=savedmodel``);
- ``trace_cache``: trace once, save many (the graph bytes kept between saves);
- ``variable_plan``: which variables a save stores, known before any tracing;
- ``object_graph``: the ``tf.Module`` tree of one model, one node per layer;
- ``layer_functions``: one layer's traced calls, ``compute_mask`` and regularizers;
- ``tracing``: traced call, regularizer and activity functions;
- ``masks``: the Keras masks a traced call takes from its inputs and gives its outputs;
- ``endpoints``: the model's positional inputs, ``serve`` and ``serving_default``;
- ``input_signature``: the input dtypes Keras' export gets wrong (subclassed models taking
  integer ids, Sequential models Keras could not link into a graph);
- ``state_variables``: variables a layer's calls use beyond its weights (metrics it holds,
  stateful RNN states), which the object graph must reach;
- ``records``: the per-layer JSON records a loader rebuilds from;
- ``layout``: the files of the directory and its metadata file;
- ``revival``: from a loaded SavedModel and its records back to a Keras model;
- ``standins``: layers that stand in for a class that is missing at load time.
- ``rnn_states``: a stateful RNN's states shared with the traced functions that use them.
"""

from trainer.save_backends.savedmodel.backend import SavedModelBackend

__all__ = ["SavedModelBackend"]
