"""Training state that travels with every checkpoint, independent of the save format.

Kept as a plain dataclass of named, typed, JSON-friendly fields so that every backend can
store it the same way (a JSON string) and resume logic never depends on a backend's
internals. ``extra`` is left for your own records.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

# Keys that checkpoints written before the state had typed fields keep under ``extra``.
LEGACY_EXTRA = (
    "history",
    "checkpoints",
    "metric_variables",
    "numpy_rng",
    "callbacks",
    "stopped_early",
)
# Field -> the JSON types it may hold (None allowed where the default is None).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "metrics": (dict,),
    "history": (list,),
    "checkpoints": (list,),
    "metric_variables": (list,),
    "numpy_rng": (list, type(None)),
    "callbacks": (dict,),
    "stopped_early": (bool,),
    "extra": (dict,),
}


@dataclasses.dataclass
class TrainingState:
    """Where training stands: enough to resume exactly.

    ``epoch`` counts completed epochs; ``step_in_epoch`` counts batches already consumed
    from the current epoch (0 at an epoch boundary); ``global_step`` counts every
    optimizer step since the start of the run. The other fields belong to one component
    each, named after it.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    seed: int | None = None
    # Logs of the last completed epoch, and one ``{"epoch": n, **logs}`` per completed epoch.
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # CheckpointManager: one retention record per kept checkpoint (name, step, epoch, ...).
    checkpoints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # The compiled metrics' accumulators at the save, so a mid-epoch resume logs the same
    # epoch metrics; NumPy's global RNG state (``numpy.random.get_state`` as JSON).
    metric_variables: list[Any] = dataclasses.field(default_factory=list)
    numpy_rng: list[Any] | None = None
    # Callbacks' own state by name (EarlyStopping's wait and best...), and whether one of
    # them ended the run (a resume then has nothing left to train).
    callbacks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    stopped_early: bool = False
    # Your own JSON-friendly records, under keys of your choosing.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a new dict of copies, as ``dataclasses.asdict`` gives them, but a
        list of plain values is copied at once: asdict copied NumPy's RNG record (624
        ints) one int at a time, most of the state's cost in every save."""
        return {f.name: _copied(getattr(self, f.name), True) for f in dataclasses.fields(self)}

    def copy(self) -> TrainingState:
        """A deep copy sharing nothing mutable, lists of plain values copied at once as in
        ``to_dict`` (an async save copies the state while the training thread waits)."""
        fields = {f.name: _copied(getattr(self, f.name), False) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingState:
        if not isinstance(data, dict):
            raise TypeError(
                f"Training state must be a JSON object; received {type(data).__name__}: {data!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"Training state has unknown keys {unknown}; this checkpoint was written by a "
                f"newer trainer. Upgrade trainer to load it. Received keys: {sorted(data)}"
            )
        data = _from_legacy(data)
        for name, types in FIELD_TYPES.items():
            if name in data and not isinstance(data[name], types):
                raise ValueError(
                    f"Training state field {name!r} must be a JSON "
                    f"{' or '.join('null' if t is type(None) else t.__name__ for t in types)}; "
                    f"received {type(data[name]).__name__}: {data[name]!r}"
                )
        for record in data.get("checkpoints", ()):
            check_record(record)
        state = cls(**data)
        for name in ("epoch", "step_in_epoch", "global_step"):
            value = getattr(state, name)
            if not is_count(value):
                raise ValueError(
                    f"Training state field {name!r} must be a non-negative integer; "
                    f"received {value!r}"
                )
        return state

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        return cls.from_dict(json.loads(text))


def check_record(record: Any) -> None:
    """A retention record names a checkpoint that retention may delete later: only a plain
    entry of the checkpoint directory (no separator, no ``..``, not hidden), with the
    fields retention sorts and filters by. A stored name such as ``../data`` or an
    absolute path would have been deleted by the next resumed save's retention."""
    if not isinstance(record, dict):
        raise ValueError(f"a retention record must be a JSON object; received {record!r}")
    name = record.get("name")
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", "\0"))
    ):
        raise ValueError(
            f"retention record names {name!r}, which is not a plain entry of a checkpoint "
            f"directory (no path separator, not hidden); received record {record!r}"
        )
    for key, (valid, wanted) in _RECORD_FIELDS.items():
        if (key == "step" or key in record) and not valid(record.get(key)):
            raise ValueError(
                f"retention record field {key!r} must be {wanted}; received record {record!r}"
            )


def is_count(value: Any) -> bool:
    """A non-negative integer (a bool is not one), as counters are stored in JSON."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_number(value: Any) -> bool:
    """An int or float (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# The fields retention sorts and filters by ("step" is required: the order), their check
# and what they must be.
_RECORD_FIELDS = {
    "step": (is_count, "an integer >= 0"),
    "epoch": (is_count, "an integer >= 0"),
    "epoch_end": (lambda value: isinstance(value, bool), "a boolean"),
    "monitor": (lambda value: value is None or is_number(value), "a number or null"),
}


_PLAIN_TYPES = frozenset((int, float, str, bool, type(None)))


def copy_json_like(value: Any) -> Any:
    """A deep copy of nested dicts, lists and tuples, those of plain values copied at once
    (``copy.deepcopy`` walked a save's records and metadata value by value, in the
    training thread's wait)."""
    return _copied(value, False)


def _copied(value: Any, as_dicts: bool) -> Any:
    """A deep copy of a field's value, a list, tuple or dict of plain values copied at once;
    a dataclass in it becomes a dict if ``as_dicts`` (as ``dataclasses.asdict`` makes it),
    else a deep copy of it."""
    if isinstance(value, dict):
        if _PLAIN_TYPES.issuperset(map(type, value.values())):
            return dict(value)  # a history entry: one per epoch, copied by every save
        return {key: _copied(item, as_dicts) for key, item in value.items()}
    if type(value) in (list, tuple):
        if _PLAIN_TYPES.issuperset(map(type, value)):  # C speed: NumPy's RNG holds 624 ints
            return type(value)(value)
        return type(value)(_copied(item, as_dicts) for item in value)
    if as_dicts and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value if type(value) in _PLAIN_TYPES else copy.deepcopy(value)


def _from_legacy(data: dict[str, Any]) -> dict[str, Any]:
    """A state written before the typed fields: move their values out of ``extra``."""
    extra = data.get("extra")
    if not isinstance(extra, dict) or not any(key in extra for key in LEGACY_EXTRA):
        return data
    data, extra = dict(data), dict(extra)
    for key in LEGACY_EXTRA:
        if key in extra:
            value = extra.pop(key)
            data.setdefault(key, value)
    data["extra"] = extra
    return data
