"""The Hydra application behind ``python train.py``: ``train(cfg)`` and what it runs.

* ``entry``: what ``train.py`` does around ``train(cfg)``: exit codes, errors, sweeps.
* ``loop``: ``train(cfg)``: build everything from the config, fit, checkpoint.
* ``config``: the structured configs (defaults in code); ``instantiation``: ``_target_``.
* ``building``: the configured model, compiled; ``distribute``: tf.distribute strategies.
* ``resume``: the checkpoint to continue from; ``run_end``: final metrics and the export.
* ``progress``: step counting, the progress bar, scalars; ``user_callbacks``: ``conf/callbacks``.
* ``interrupts``: the one stack of SIGTERM / SIGINT handlers; ``sweeps``: a signal stops a sweep.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # ``trainer.training.train``, imported on first use
    if name == "train":
        from trainer.training.loop import train

        return train
    raise AttributeError(f"module 'trainer.training' has no attribute {name!r}")
