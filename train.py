"""Entry point: `python train.py [group=option ...] [key=value ...]` (see conf/).

A deliberate error prints one `error: ...` line and exits 2 (HYDRA_FULL_ERROR=1 for the
traceback); see trainer/training/entry.py. SIGTERM or Ctrl-C at any point exits 0 (see
trainer/training/interrupts.py)."""

from trainer.console import quiet_tensorflow, survive_broken_pipes
from trainer.training import interrupts  # both standard library only

if __name__ == "__main__":
    # First: SIGTERM or Ctrl-C during start-up exits 0 with one line.
    interrupts.begin_startup()
    # A console pipe whose reader is gone (`| tee` ended by Ctrl-C) must not end the run.
    survive_broken_pipes()

# Before anything imports TensorFlow: log levels, start-up chatter, one log handler.
quiet_tensorflow()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from trainer.training import entry  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return entry.job(cfg)  # the objective a Hydra sweeper would optimise


if __name__ == "__main__":
    entry.run(main)
