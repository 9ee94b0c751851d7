"""What a session reads and writes on disk, besides training: the run directory (checked
writable before anything is built), the save backend ``save`` configures, and the
checkpoint a session resumes from, restored into the model the config built.

Split from ``loop``, which sequences a session: these pieces are looked up by it at
several points (the backend class at locating, building and restoring) and have no state
of their own. Log lines keep ``loop``'s logger name: the tutorials' console samples show
the "Resuming from" line under it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
import keras
from omegaconf import DictConfig

from trainer.errors import ConfigError
from trainer.model_state import kit
from trainer.save_backends import SaveBackend, load_checkpoint
from trainer.state import TrainingState
from trainer.storage.atomic import temporary_sibling
from trainer.training import resume
from trainer.training.instantiation import instantiate

# ``loop``'s logger: the lines moved here with these functions appear under it in the docs.
log = logging.getLogger("trainer.training.loop")


def restore(cfg: DictConfig, dist, model: keras.Model, path: Path) -> TrainingState:
    """Put the checkpoint at ``path`` into ``model`` after checking it fits the config."""
    # The classes of the model the config just built: a user's own layer that was never
    # registered is recorded by its bare name, which only custom_objects resolves.
    own = kit.own_classes(model)
    loaded = load_checkpoint(path, configured=configured_backend(cfg), custom_objects=own)
    resume.check_compatible(cfg, loaded.metadata, path, loaded.state)
    with dist.scope():  # may build the optimizer: its variables are distributed too
        state = resume.restore_into(model, loaded)
    log.info(
        "Resuming from %s at epoch %d, step %d (+%d in epoch)",
        path,
        state.epoch,
        state.global_step,
        state.step_in_epoch,
    )
    return state


def configured_backend(cfg: DictConfig) -> type:
    """The class of the run's configured save backend: resuming reads the run's own
    checkpoints with it when it is not registered (``save._target_``)."""
    return type(build_backend(cfg))


def build_backend(cfg: DictConfig) -> SaveBackend:
    """The save backend ``save`` configures; anything else is a ``ConfigError``."""
    backend = instantiate(cfg.save, "save")
    if not isinstance(backend, SaveBackend):
        raise ConfigError(
            f"save._target_ must build a save backend (a subclass of "
            f"trainer.save_backends.SaveBackend), such as save=savedmodel, save=h5 or "
            f"save=weights. Received: {cfg.save.get('_target_')!r}, which built a "
            f"{type(backend).__name__}"
        )
    return backend


def resolve_run_dir(cfg: DictConfig) -> Path:
    """Hydra's output directory when run under Hydra, else ``cfg.run_dir`` or the cwd."""
    explicit = cfg.get("run_dir")
    if explicit:
        path = Path(explicit)
    elif hydra.core.hydra_config.HydraConfig.initialized():
        path = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    else:
        path = Path(os.getcwd())
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = temporary_sibling(path / "write-check")
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"The run directory {path} cannot be written: {error.strerror or error}. Pass a "
            f"writable run_dir=... (or hydra.run.dir=...). Received: {os.fspath(path)!r}"
        ) from None
    return path
