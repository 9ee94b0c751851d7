"""Entry point: `python train.py [group=option ...] [key=value ...]` (see conf/)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ chatter out of logs

import hydra
from omegaconf import DictConfig

from trainer.training import train


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    metrics = train(cfg)
    return next(iter(metrics.values()))  # the objective a Hydra sweeper would optimise


if __name__ == "__main__":
    main()
