"""Internals of the SavedModel save backend: tracing, per-layer records, revival.

The public entry point is ``trainer.save_backends.savedmodel.SavedModelBackend``.
"""
