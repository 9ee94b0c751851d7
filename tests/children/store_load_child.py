"""Child process for the test of two processes loading one checkpoint of a store at once:
announce that its imports are done, wait for the parent's go, load the checkpoint (through
the local cache, empty at first) and save the model's predictions of fixed inputs.

    python store_load_child.py CHECKPOINT_URL READY_FILE GO_FILE OUT_NPY

Nothing here measures time: the parent stops a hung child.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

from trainer.save_backends import load_checkpoint


def inputs(width: int) -> np.ndarray:
    """The fixed inputs both children and the parent predict."""
    return np.linspace(-1.0, 1.0, 2 * width, dtype="float32").reshape(2, width)


def main() -> None:
    url, ready, go, out = sys.argv[1:5]
    import keras  # noqa: F401  (imported before "ready": the loads then start together)

    Path(ready).write_text(str(os.getpid()))
    while not Path(go).exists():
        time.sleep(0.01)
    checkpoint = load_checkpoint(url)
    width = checkpoint.model.inputs[0].shape[-1]
    np.save(out, checkpoint.model.predict(inputs(width), verbose=0))


if __name__ == "__main__":
    main()
