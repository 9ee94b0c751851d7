"""A stand-in loader for testing the corruption fuzzer's runner itself: the name of the path
asks for the outcome (``crash-*`` aborts the process, ``hang-*`` sleeps, ``raise-*`` raises
an AttributeError, anything else is refused with a ``TrainerError``).

Test-only, named as the loader of the fuzzer's child process (``corruption.run(loader=
"fuzz_faults:load_checkpoint")``), which finds it on the path that
``tests.helpers.processes.subprocess_env`` gives children. Imports no TensorFlow: the child
starts fast.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.errors import CorruptCheckpointError


def load_checkpoint(path, **options):
    name = Path(path).name
    if name.startswith("crash"):
        os.abort()
    if name.startswith("hang"):
        time.sleep(600)
    if name.startswith("raise"):
        raise AttributeError(f"a bug while loading {name}")
    raise CorruptCheckpointError(f"{path}: refused by the stand-in (options {options})")
