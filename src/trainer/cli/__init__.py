"""``trainer`` / ``python -m trainer``: the command-line interface.

* ``main``: the argument parser, ``inspect`` and ``verify``'s entry.
* ``commands``: ``export``, ``runs``, ``import-legacy``.
* ``verify``: the complete check of a checkpoint or an export.
"""
