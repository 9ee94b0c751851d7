"""Checkpointing in one place: any Keras user's, and ``train(cfg)``'s.

* ``CheckpointManager`` (``manager.py``): one directory of checkpoints: save, list, restore,
  retention, the ``latest`` pointer, async writes, stale-temporary cleanup. No Hydra needed.
  Behind it: ``writing.py`` (a save's write, ``latest``, retention, the time a save held
  training), ``set_aside.py`` (an abandoned continuation's checkpoints, on disk) and
  ``on_store.py`` (what differs on object storage).
* ``Checkpoint`` (``callback.py``; also ``trainer.callbacks.Checkpoint``): the Keras callback
  that decides when to save, and resumes a re-run script (``resume="auto"``).
* ``CheckpointPolicy`` (``policy.py``): names, triggers, retention; validated when built.
* Wrapping backends (``wrappers.py``): ``AsyncBackend(inner)`` writes in the background;
  ``trainer.training.distribute.ScratchBackend`` (a non-chief worker's saves) is another.
* ``snapshot.py``: the shadow model an async write works from; ``rehearsal.py``: the
  start-of-training rehearsal write that pays a backend's first-save work outside the
  checkpoint directory; ``callback_state.py``: the state of Keras callbacks, saved with
  each checkpoint; ``listing.py``: a directory's complete checkpoints, the newest, the
  ``latest`` link; ``restoring.py``: a loaded checkpoint into an existing model.
"""

from trainer.checkpointing.keras_callback import Checkpoint
from trainer.checkpointing.listing import complete_checkpoints, find_latest, point_latest
from trainer.checkpointing.manager import ABANDONED, CheckpointManager
from trainer.checkpointing.policy import CheckpointPolicy, format_name, name_fields, retained
from trainer.checkpointing.restoring import numpy_rng_record, restore_into
from trainer.checkpointing.shadow import all_variables, clone_for_snapshot
from trainer.checkpointing.snapshot import AsyncWriter, refresh_snapshot
from trainer.checkpointing.wrappers import AsyncBackend, WrappingBackend, innermost
from trainer.storage.locks import LATEST

__all__ = [
    "ABANDONED",
    "LATEST",
    "AsyncBackend",
    "AsyncWriter",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointPolicy",
    "WrappingBackend",
    "all_variables",
    "clone_for_snapshot",
    "complete_checkpoints",
    "find_latest",
    "format_name",
    "innermost",
    "name_fields",
    "numpy_rng_record",
    "point_latest",
    "refresh_snapshot",
    "restore_into",
    "retained",
]
