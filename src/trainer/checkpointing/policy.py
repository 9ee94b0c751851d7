"""What a checkpoint is called, when one is due and which ones are kept (``conf/checkpoint``).

Plain data and pure functions: the manager applies them, the callback decides when to save.
"""

from __future__ import annotations

import dataclasses
import logging
import string
from collections.abc import Iterable
from typing import Any

import numpy as np

from trainer.errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointPolicy:
    """When to save and what to keep (``conf/checkpoint``), validated when built.

    Attributes:
        every_n_epochs: Save at the end of every N-th epoch; None: not by epoch.
        every_n_steps: Save every N optimizer steps (mid-epoch too); None: not by step.
        on_train_end: Save when training ends.
        on_interrupt: Save when SIGTERM or SIGINT stops training (after the batch in flight).
        keep_last: Keep the newest N; None: keep all.
        keep_best: Keep the best K by ``monitor``; 0: none kept for being best.
        monitor: The logged metric ``keep_best`` ranks by (``val_loss``).
        mode: ``"min"`` or ``"max"``: how ``monitor`` improves.
        keep_every_n_epochs: Keep every M-th epoch end forever; None: none.
        name: The name pattern: ``{step}``, ``{epoch}`` and any logged metric, with format
            specs (``"epoch-{epoch:03d}-{loss:.3f}"``).
        async_save: Write in a background thread; None: the backend's default (on for
            ``savedmodel`` and ``weights``).
        on_save_error: ``"raise"`` stops training on a failed save; ``"continue"`` logs it
            and keeps training.

    Raises:
        ConfigError: A value of the wrong type or out of range (``keep_last=2.5``,
            ``mode="up"``), or a ``name`` that is a path, hidden, ``latest`` or malformed.
    """

    every_n_epochs: int | None = 1
    every_n_steps: int | None = None
    on_train_end: bool = True
    on_interrupt: bool = True
    keep_last: int | None = 3
    keep_best: int = 1
    monitor: str = "val_loss"
    mode: str = "min"
    keep_every_n_epochs: int | None = None
    name: str = "step-{step:08d}"
    async_save: bool | None = None  # None: the backend's own default
    on_save_error: str = "raise"  # "continue": log a failed save and keep training

    def __post_init__(self):
        _check_types(self)
        if self.on_save_error not in ("raise", "continue"):
            raise ConfigError(
                f"checkpoint.policy.on_save_error must be 'raise' (stop training) or "
                f"'continue' (log it and keep training). Received: {self.on_save_error!r}"
            )
        if self.mode not in ("min", "max"):
            raise ConfigError(
                f"checkpoint.policy.mode must be 'min' or 'max' (how checkpoint.policy.monitor "
                f"improves). Received: {self.mode!r}"
            )
        for field in ("every_n_epochs", "every_n_steps", "keep_last", "keep_every_n_epochs"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ConfigError(
                    f"checkpoint.policy.{field} must be a positive integer or null. "
                    f"Received: {value!r}"
                )
        if self.keep_best < 0:
            raise ConfigError(
                f"checkpoint.policy.keep_best must be 0 (keep no best ones) or more. "
                f"Received: {self.keep_best!r}"
            )
        check_plain_name(self.name)  # a malformed pattern fails here too

    def check_name(self, metrics: Iterable[str], *, validation: bool) -> None:
        """Refuse, before training, a ``name`` pattern that some save could not fill.

        Step and interrupt saves can fall mid-epoch, before validation, so ``val_*`` fields
        are allowed only when every save is an epoch end.

        Args:
            metrics: The names the model logs at every batch (``loss``, ``accuracy``).
            validation: Whether the run has validation data (``val_*`` exist at epoch ends).

        Raises:
            ConfigError: A field no save knows, or a ``val_*`` field some save lacks.
        """
        known = set(metrics)
        fields = name_fields(self.name)
        unknown = [
            f for f in fields if f not in NAME_FIELDS and f not in known and f[4:] not in known
        ]
        validated = [f for f in fields if f.startswith("val_") and f[4:] in known]
        problem = None
        if unknown:
            problem = (
                f"uses {{{unknown[0]}}}, which no save knows (placeholders: step, epoch, "
                f"{', '.join(sorted(known))} and their val_ versions)"
            )
        elif validated and not validation:
            problem = f"uses {{{validated[0]}}}, but the run has no validation data"
        elif validated and (self.every_n_steps or self.on_interrupt):
            problem = (
                f"uses {{{validated[0]}}}, which step and interrupt saves (taken mid-epoch, before "
                f"validation) do not have; set checkpoint.policy.every_n_steps=null and "
                f"checkpoint.policy.on_interrupt=false, or name them by a training metric"
            )
        if problem:
            raise ConfigError(
                f"checkpoint.policy.name {problem}. Use {{step}}, {{epoch}} or a logged metric. "
                f"Received: {self.name!r}"
            )
        self._check_monitor(known, validation=validation)

    def _check_monitor(self, known: set[str], *, validation: bool) -> None:
        """A ``monitor`` no save logs kept no best checkpoint, silently (a typo)."""
        base = self.monitor[4:] if self.monitor.startswith("val_") else self.monitor
        if not self.keep_best:
            return
        if base not in known:
            raise ConfigError(
                f"checkpoint.policy.monitor {self.monitor!r} is not a metric this run logs, so "
                f"no best checkpoint would be kept. Use one of {sorted(known)} (or its val_ "
                f"version), or checkpoint.policy.keep_best=0. Received: {self.monitor!r}"
            )
        if base != self.monitor and not validation:
            log.warning(
                "checkpoint.policy.monitor=%s: the run has no validation data, so no best "
                "checkpoint is kept (checkpoint.policy.keep_best=%d is unused)",
                self.monitor,
                self.keep_best,
            )


NAME_FIELDS = ("step", "epoch")
# The field types of ``CheckpointPolicy`` (its annotations, strings here: ``int | None``),
# and how a message names each.
_KINDS = {"int": (int, "an integer"), "bool": (bool, "true or false"), "str": (str, "a string")}


def _check_types(policy: CheckpointPolicy) -> None:
    """Each field of the type its annotation declares (``keep_last=2.5`` failed inside
    ``fit`` after the first saves; ``async_save='no'`` turned async saving on)."""
    for field in dataclasses.fields(policy):
        value = getattr(policy, field.name)
        base, *rest = str(field.type).split(" | ")
        optional = "None" in rest
        if (value is None and optional) or base not in _KINDS:  # a subclass's own field
            continue
        cls, kind = _KINDS[base]
        # A bool is an int to Python, not to a config: true is no number of checkpoints.
        if not isinstance(value, cls) or (cls is int and isinstance(value, bool)):
            none = " or null" if optional else ""
            raise ConfigError(
                f"checkpoint.policy.{field.name} must be {kind}{none}. "
                f"Received: {value!r} ({type(value).__name__})"
            )


def check_plain_name(pattern: str) -> None:
    """A checkpoint name is one entry of the checkpoint directory: a pattern holding a
    path (``../other-run/step-{step}``) wrote into another run's checkpoints, a hidden one
    (``.ck-{step}``) or ``latest`` were never found again by a resume."""
    sample = pattern.format(**{f: 0 for f in name_fields(pattern)})
    problem = None
    if not sample or "/" in pattern or "\\" in pattern or "\0" in pattern:
        problem = "must be a plain file name, without a path"
    elif sample.startswith("."):
        problem = "must not start with '.' (hidden names are the temporaries of saves)"
    elif sample == "latest":
        problem = "must not be 'latest' (the link to the newest checkpoint)"
    if problem:
        raise ConfigError(
            f"checkpoint.policy.name {problem}: each checkpoint is an entry of the checkpoint "
            f"directory (checkpoint.directory). Use a pattern such as 'step-{{step:08d}}'. "
            f"Received: {pattern!r}"
        )


def name_fields(pattern: str) -> list[str]:
    """The placeholders of a name pattern.

    Args:
        pattern: A ``CheckpointPolicy.name`` such as ``"step-{step:08d}"``.

    Returns:
        The field names, in order (``["step"]``).

    Raises:
        ConfigError: The pattern is malformed.
    """
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
        pattern.format(**{f: 0 if f in NAME_FIELDS else 0.0 for f in fields if f.isidentifier()})
    except (ValueError, IndexError, KeyError, TypeError) as error:
        fields = None
        reason = str(error)
    if fields is None or not all(f.isidentifier() for f in fields):
        raise ConfigError(
            f"checkpoint.policy.name must be a format pattern with named placeholders such as "
            f"'step-{{step:08d}}' or 'epoch-{{epoch:03d}}-{{loss:.3f}}'"
            f"{f' ({reason})' if fields is None else ''}. Received: {pattern!r}"
        )
    return fields


def format_name(pattern: str, *, step: int, epoch: int, metrics: dict[str, float]) -> str:
    """The name of one checkpoint.

    Args:
        pattern: A ``CheckpointPolicy.name``.
        step: The global step.
        epoch: The epoch.
        metrics: The logged values the pattern may use.

    Returns:
        The checkpoint's name.

    Raises:
        ConfigError: The pattern uses a placeholder this save lacks.
    """
    try:
        return pattern.format(step=step, epoch=epoch, **metrics)
    except KeyError as error:
        raise ConfigError(
            f"checkpoint.policy.name uses {{{error.args[0]}}}, which this save (step {step}) "
            f"does not log. Use {{step}}, {{epoch}} or one of its metrics: "
            f"{', '.join(sorted(metrics)) or 'none'}. Received: {pattern!r}"
        ) from None


def retained(records: list[dict[str, Any]], policy: CheckpointPolicy) -> set[str]:
    """The checkpoints retention keeps.

    Args:
        records: One retention record per checkpoint (``name``, ``step``, ``epoch``,
            ``monitor``, ``epoch_end``).
        policy: The ``keep_*`` settings.

    Returns:
        The names to keep: the newest always, the last N, the best K, every M-th epoch end.
    """
    if not records:
        return set()
    by_step = sorted(records, key=lambda r: r["step"])
    keep = {by_step[-1]["name"]}
    if policy.keep_last is None:
        keep.update(r["name"] for r in records)
    else:
        keep.update(r["name"] for r in by_step[-policy.keep_last :])
    scored = [r for r in records if r.get("monitor") is not None]
    if policy.keep_best and scored:
        best = sorted(scored, key=lambda r: r["monitor"], reverse=policy.mode == "max")
        keep.update(r["name"] for r in best[: policy.keep_best])
    if policy.keep_every_n_epochs:
        keep.update(
            r["name"]
            for r in records
            if r.get("epoch_end")
            and r.get("epoch")
            and r["epoch"] % policy.keep_every_n_epochs == 0
        )
    return keep


def scalar_metrics(logs: dict[str, Any] | None) -> dict[str, float]:
    """The scalar entries of ``logs`` as floats: what a checkpoint's state records, names
    and monitors. Array-valued metrics (``F1Score(average=None)``, ``Precision`` at several
    thresholds) are left out of that record; their accumulators are saved with the other
    metric variables."""
    found = {}
    for key, value in (logs or {}).items():
        array = np.asarray(value)
        if array.ndim == 0 and np.issubdtype(array.dtype, np.number):
            found[key] = float(array)
    return found
