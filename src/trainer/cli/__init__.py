"""``trainer`` / ``python -m trainer``: the command-line interface.

* ``app``: the argument parser and ``main``, ``inspect``.
* ``commands``: ``export``, ``runs``, ``import-legacy``.
* ``verify``: the complete check of a checkpoint or an export.
"""

from trainer.cli.app import main

__all__ = ["main"]
