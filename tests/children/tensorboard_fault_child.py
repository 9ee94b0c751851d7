"""Child process for the TensorBoard disk-fault tests: a real training run whose files may
not grow past LIMIT_BYTES from global step 5 on (``RLIMIT_FSIZE``, SIGXFSZ ignored: writes
fail with EFBIG exactly where a full disk fails with ENOSPC; see disk_fault_child.py).

    python tensorboard_fault_child.py OUT_DIR LIMIT_BYTES ON_SAVE_ERROR EVERY_N_STEPS

Prints one JSON line (the last line of stdout): how training ended and every warning or
error the trainer logged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from disk_fault_child import ROOT, full_disk_run, limit_file_size, listing


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def main(out: Path, limit: int, on_save_error: str, every_n_steps: str) -> dict:
    from hydra import compose, initialize_config_dir

    from trainer.save_backends import load_checkpoint
    from trainer.training.loop import train

    overrides = [
        "save=weights",
        "checkpoint.policy.async_save=false",
        f"checkpoint.policy.every_n_steps={every_n_steps}",
        *full_disk_run(out, on_save_error, limit),
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=overrides)
    collect = Collect()
    logging.getLogger("trainer").addHandler(collect)
    try:
        metrics = train(cfg)
        outcome = {"finished": True, "metrics": metrics}
    except Exception as error:  # the test names what it expects; anything else fails it
        outcome = {
            "finished": False,
            "error": type(error).__name__,
            "mro": [c.__name__ for c in type(error).__mro__],
            "message": str(error),
        }
    limit_file_size(None)
    checkpoints = out / "checkpoints"
    steps = {
        name: load_checkpoint(checkpoints / name, verify=True).state.global_step
        for name in listing(checkpoints)
        if not name.startswith(".") and name != "latest"
    }
    return {**outcome, "checkpoints": steps, "log": collect.lines}


if __name__ == "__main__":
    out, limit, on_error, every = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    print(json.dumps(main(out, limit, on_error, every)))
