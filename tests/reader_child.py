"""Child process for the concurrent-reader test: load ``latest`` in a loop while a trainer
writes, and report every load (digests verified) as JSON on the last line of stdout.

    python reader_child.py CHECKPOINT_DIR LOADS DEADLINE_SECONDS
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from trainer.errors import TrainerError
from trainer.save_backends import load_checkpoint


class Counter(logging.Handler):
    """Counts the reads ``load_checkpoint`` started over because the writer moved on."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += "reading it again" in record.getMessage()


def main(directory: Path, wanted: int, deadline: float) -> dict:
    restarts = Counter()
    logger = logging.getLogger("trainer.save_backends.registry")
    logger.addHandler(restarts)
    logger.setLevel(logging.INFO)
    loads, failures, mismatches, steps = 0, [], [], set()
    stop = time.monotonic() + deadline
    while not (directory / "latest").exists():  # started with the trainer: wait for it
        if time.monotonic() > stop:
            return {"loads": 0, "failures": ["the trainer wrote no checkpoint"]}
        time.sleep(0.05)
    stop = time.monotonic() + deadline
    while loads + len(failures) < wanted and time.monotonic() < stop:
        try:
            # Digests of every file verified; compile=False skips only rebuilding the
            # optimizer, which keeps each load short on a machine shared with the trainer.
            checkpoint = load_checkpoint(directory / "latest", verify=True, compile=False)
        except (TrainerError, OSError) as error:
            failures.append(f"{type(error).__name__}: {error}"[:300])
            continue
        except Exception as error:  # reported as a failure of a different kind
            failures.append(f"raw {type(error).__name__}: {error}"[:300])
            continue
        loads += 1
        step = checkpoint.state.global_step
        steps.add(step)
        if checkpoint.path.name != f"step-{step:08d}":  # the files of one checkpoint only
            mismatches.append(f"{checkpoint.path.name} holds step {step}")
    return {
        "loads": loads,
        "failures": failures,
        "mismatches": mismatches,
        "distinct_steps": len(steps),
        "restarted_reads": restarts.count,
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))))
