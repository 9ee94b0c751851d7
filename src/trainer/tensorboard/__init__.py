"""A run's TensorBoard log.

* ``board``: hparams, serving graph, checkpoint cards, links between runs and exports.
* ``summary_writes``: every write under ``checkpoint.policy.on_save_error``.
* ``hparams``: one HParams session per run.
"""
