"""Training state that travels with every checkpoint, independent of the save format.

Kept as a plain dataclass of JSON-friendly values so that every backend can store it
the same way (a JSON string) and resume logic never depends on a backend's internals.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass
class TrainingState:
    """Where training stands: enough to resume exactly.

    ``epoch`` counts completed epochs; ``step_in_epoch`` counts batches already consumed
    from the current epoch (0 at an epoch boundary); ``global_step`` counts every
    optimizer step since the start of the run.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    seed: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # Later features (RNG states, best-metric trackers, TensorBoard step...) put their
    # JSON-friendly records here under their own key rather than growing the schema.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
        state = cls(**data)
        for name in ("epoch", "step_in_epoch", "global_step"):
            value = getattr(state, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"Training state field {name!r} must be a non-negative integer; "
                    f"received {value!r}"
                )
        return state

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        return cls.from_dict(json.loads(text))
