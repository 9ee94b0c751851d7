"""Entry point: `python train.py [group=option ...] [key=value ...]` (see conf/)."""

from trainer.console import quiet_tensorflow

# Before anything imports TensorFlow: log levels, start-up chatter, one log handler.
quiet_tensorflow()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from trainer.training import train  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    metrics = train(cfg)
    return next(iter(metrics.values()))  # the objective a Hydra sweeper would optimise


if __name__ == "__main__":
    main()
