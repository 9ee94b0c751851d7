"""Runs the plain-Keras tutorial (docs/tutorials/keras-script.md) as written, in this process.

``python plain_keras_child.py OUT [--kill-at STEP] [--replace OLD NEW]...``: extracts the
block after the ``plain-keras-example`` marker from docs/tutorials/keras-script.md, applies
the textual replacements (the backend, the policy), optionally adds a callback that
SIGKILLs this process after global step STEP (``faults.SignalAtStep``, appended to the
callbacks of every ``fit``), runs the block in the current directory and writes every
variable of its ``model`` (weights, RNG seed states, optimizer) to ``OUT`` (.npz).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "keras-script.md"
MARKER = "<!-- plain-keras-example"


def example() -> str:
    text = TUTORIAL.read_text()
    block = text[text.index(MARKER) :]
    start = block.index("```python\n") + len("```python\n")
    return block[start : block.index("```", start)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--replace", nargs=2, action="append", default=[])
    args = parser.parse_args()
    code = example()
    for old, new in args.replace:
        assert old in code, old
        code = code.replace(old, new)
    tf.config.experimental.enable_op_determinism()
    if args.kill_at:
        from faults import SignalAtStep

        fit = keras.Model.fit

        def fit_then_die(self, *a, callbacks=None, **kw):
            kill = SignalAtStep(args.kill_at, int(signal.SIGKILL))
            return fit(self, *a, callbacks=[*(callbacks or []), kill], **kw)

        keras.Model.fit = fit_then_die
    namespace: dict = {}
    exec(compile(code, "keras-script.md", "exec"), namespace)
    model = namespace["model"]
    variables = [*model.variables, *model.optimizer.variables]
    np.savez(args.out, *[keras.ops.convert_to_numpy(v) for v in variables])


if __name__ == "__main__":
    main()
