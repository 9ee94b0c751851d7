"""The one place allowed to touch Keras and TensorFlow internals.

Everything else in trainer uses public APIs only (ruff's banned-API rule, TID251, enforces
it: ``keras.src`` and ``tensorflow.python`` are refused outside this package). Each helper
here says which private name it uses, why no public API does the job, and which Keras or
TensorFlow versions it was checked against; ``tests/_compat/test_canaries.py`` has canaries that
fail when an upstream change makes a workaround unnecessary or wrong.
"""
