"""Composing the run config in tests: tiny overrides and the options of a config group."""

from __future__ import annotations

from tests.helpers.paths import CONF_DIR

# Small enough that a whole training run takes a second or two on 2 cores.
TINY = [
    "data=synthetic",
    "trainer.epochs=2",
    "trainer.batch_size=16",
    "trainer.steps_per_epoch=3",
    "trainer.verbose=0",
    "export.enabled=false",  # the serving export has tests of its own
]


def config_options(group: str) -> list[str]:
    """Every option of a config group, read from ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_run(run_dir, *overrides: str, tiny: bool = True):
    """The run config writing to ``run_dir`` (the ``compose_cfg`` fixture's, without its
    function scope): for module-scoped fixtures that train one run several tests read."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(
            "config", overrides=[*(TINY if tiny else []), f"run_dir={run_dir}", *overrides]
        )
