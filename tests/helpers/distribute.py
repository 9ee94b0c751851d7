"""What the tf.distribute tests share (``tests/training/test_distribute.py`` and
``test_chief_decides.py``): the base run config whose runs compare across strategies, and
the comparison of a checkpoint's variables within the tolerance a strategy needs.

Tolerance: a step under a strategy sums per-replica gradients in another order than one
device does, so variables agree to ``RTOL``/``ATOL`` (measured on this model after 6-9
steps: max abs difference 2e-7, relative 1e-6), not bitwise. Runs under the same strategy
are bitwise repeatable, including an interrupted and resumed one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.config import TINY
from trainer.checkpointing import all_variables
from trainer.save_backends import load_checkpoint

RTOL, ATOL = 1e-5, 1e-6
# No dropout where runs under different strategies are compared: each replica draws its
# own masks for its share of the batch, so dropout differs by design, not by rounding.
# The tolerances were measured at this learning rate (at the default run's, 10x higher, the
# largest difference grew past them: 3e-5 relative after 6 steps of the multi-worker case).
BASE = [*TINY, "model=mlp", "model.dropout=0", "optimizer.learning_rate=0.001", "schedule=none"]


def values(checkpoint_path: Path | str) -> tuple[list[np.ndarray], object]:
    """Every variable of the checkpoint's model (weights, optimizer, RNG) and its state."""
    checkpoint = load_checkpoint(checkpoint_path)
    return [np.asarray(v.numpy()) for v in all_variables(checkpoint.model)], checkpoint.state


def assert_close(got: list[np.ndarray], want: list[np.ndarray], *, exact: bool = False):
    """Floats within RTOL/ATOL (bitwise with ``exact``); integers always bitwise."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if exact or a.dtype.kind != "f":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
