"""``trainer`` / ``python -m trainer``: the command-line interface, one module per command.

* ``app``: the argument parser and ``main``, which hands each command to its module.
* ``inspect``, ``verify``, ``export_checkpoint`` (``export``), ``runs``, ``import_legacy``
  (``import-legacy``): one command each, ``run(args)``.
"""

from trainer.cli.app import main

__all__ = ["main"]
