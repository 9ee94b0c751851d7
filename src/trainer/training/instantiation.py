"""Building objects from config nodes (``_target_``) with errors that name the config key.

Hydra's ``instantiate`` reports "Error locating target 'no.such.Thing' ... full_key: model"
or "Error in call to target 'trainer.data.make_synthetic': ValueError('zero-size array to
reduction operation ...')": neither says what to change, neither ends with what was
received, and code calling ``train(cfg)`` gets Hydra's ``InstantiationException`` rather than
a ``ConfigError``. ``instantiate`` here raises a ``ConfigError`` naming the key instead; a
``TrainerError`` the target raised itself (a loader refusing its arguments) is raised as it
is, since it already says more than Hydra's wrapper around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError, TrainerError


def instantiate(node: Any, key: str, /, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)`` for the config node at ``key`` (``model``,
    ``callbacks.NAME``): Hydra's errors become a ``ConfigError`` naming the key."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, TrainerError):
            raise cause from None
        raise _config_error(node, key, error) from error


def _config_error(node: Any, key: str, error: InstantiationException) -> ConfigError:
    target = node.get("_target_") if isinstance(node, Mapping) else None
    group = key.split(".")[0]
    cause = error.__cause__
    why = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
    why = " ".join(why.split())[:300]
    if str(error).startswith("Error locating target"):
        return ConfigError(
            f"{key}._target_ names {target!r}, which cannot be imported ({why}). Point it at "
            f"an importable class or function (its module installed or on PYTHONPATH), or "
            f"pick a shipped option with {group}=NAME (the files in conf/{group}/). "
            f"Received: {key}._target_={target!r}"
        )
    return ConfigError(
        f"{key} could not be built: {target or 'its _target_'} raised {why}. Fix the "
        f"settings of {key} (python train.py --cfg job --package {group} shows them)."
        f"{_own_target_hint(node, key, cause)} Received: {key}={_shown(node)}"
    )


def _own_target_hint(node: Any, key: str, cause: BaseException | None) -> str:
    """``model._target_=mymodule.build`` keeps the default option's other keys (resnet's
    ``blocks``, ``width``), which the user's function does not take: say how to replace the
    whole node, which nothing in Hydra's message suggests."""
    if not (isinstance(cause, TypeError) and "unexpected keyword argument" in str(cause)):
        return ""
    target = node.get("_target_") if isinstance(node, Mapping) else None
    others = [k for k in (node or {}) if k != "_target_"]
    if not target or not others:
        return ""
    return (
        f" Its keys {others} come from the option your _target_ replaced; to call "
        f"{target} with only its own arguments, replace the whole node: python train.py "
        f"'~{key}' '+{key}={{_target_: {target}}}' (your own keys inside the braces)."
    )


def _shown(node: Any) -> str:
    """The node's values, resolved where possible, in at most 300 characters."""
    if isinstance(node, DictConfig):
        try:
            node = OmegaConf.to_container(node, resolve=True)
        except Exception:  # an interpolation that does not resolve: show it unresolved
            node = OmegaConf.to_container(node, resolve=False)
    return str(node)[:300]
