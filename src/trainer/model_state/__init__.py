"""What of a Keras model a checkpoint holds, and how it comes back: shared by every save
backend, the async snapshot and the serving exports.

* ``kit``: the model-state kit for backend authors: compile config, arrays by position,
  model config and rebuild, JSON.
* ``layer_protocol``: Keras's per-layer ``save_own_variables`` / ``load_own_variables``.
* ``readiness``, ``config_check``, ``vocabularies``: what makes a model savable, checked at
  save time rather than discovered at load.
* ``trainable``: which variables the optimizer is built for; ``compile_objects``: losses and
  metrics whose configs Keras leaves short; ``dtype_policy``: the model's own dtype policy.
* ``rebuild``: "this class cannot be rebuilt" told apart from "this checkpoint is damaged".
* ``serving``: the serving function both export formats write.
* ``serializables``, ``json_tuples``: classes registered before a load, tuples back from JSON.
"""
