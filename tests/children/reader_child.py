"""Child process for the concurrent-reader test: load ``latest`` exactly LOADS times while a
trainer writes, and report every load (digests verified) as JSON on the last line of stdout.

    python reader_child.py CHECKPOINT_DIR LOADS NEW_EVERY

Every NEW_EVERY loads the reader first waits for ``latest`` to point at a checkpoint it has
not loaded yet, so that the checkpoints change under it a known number of times however
fast or slow either process runs. Nothing here measures time: the parent stops a hung run.
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


def latest_name(directory: Path) -> str | None:
    try:
        return os.readlink(directory / "latest")
    except OSError:  # not written yet, or being replaced right now
        return None


def wait_for_checkpoint_other_than(directory: Path, seen: str | None) -> None:
    while latest_name(directory) in (None, seen):
        time.sleep(0.02)


def main(directory: Path, wanted: int, new_every: int) -> dict:
    restarts = Counter()
    logger = logging.getLogger("trainer.save_backends.loading")
    logger.addHandler(restarts)
    logger.setLevel(logging.INFO)
    failures, mismatches, steps = [], [], set()
    last_loaded = None
    for attempt in range(wanted):
        if attempt % new_every == 0:
            wait_for_checkpoint_other_than(directory, last_loaded)
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
        last_loaded = checkpoint.path.name
        step = checkpoint.state.global_step
        steps.add(step)
        if checkpoint.path.name != f"step-{step:08d}":  # the files of one checkpoint only
            mismatches.append(f"{checkpoint.path.name} holds step {step}")
    return {
        "attempts": wanted,
        "loads": wanted - len(failures),
        "failures": failures,
        "mismatches": mismatches,
        "distinct_steps": len(steps),
        "restarted_reads": restarts.count,
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
