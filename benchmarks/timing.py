"""Result records and the timing loop: every figure is a list of measured seconds, or an
explicit "not available"/"error" with the reason; nothing is ever filled in."""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OK, NA, ERROR = "ok", "n/a", "error"


@dataclasses.dataclass
class Result:
    size: str
    key: str  # e.g. "savedmodel.first_save": what the report and the targets refer to
    label: str  # human-readable row name
    values: list[float] = dataclasses.field(default_factory=list)  # seconds, or steps/s
    status: str = OK
    note: str = ""
    nbytes: int | None = None
    unit: str = "s"  # "s" for durations, "steps/s" for throughput rows

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values and self.status == OK else None

    @property
    def low(self) -> float | None:
        return min(self.values) if self.values and self.status == OK else None

    @property
    def high(self) -> float | None:
        return max(self.values) if self.values and self.status == OK else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(median=self.median, min=self.low, max=self.high)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def not_available(size: str, key: str, label: str, why: str) -> Result:
    return Result(size, key, label, status=NA, note=why)


def timed(
    size: str,
    key: str,
    label: str,
    action: Callable[[int], Any],
    repeats: int,
    *,
    before: Callable[[int], Any] | None = None,
    after: Callable[[int, Any], Any] | None = None,
    artifact: Callable[[int], Path] | None = None,
) -> Result:
    """Time ``action(i)`` for i in range(repeats); ``before``/``after`` run untimed.

    ``artifact(i)`` names what the action wrote, so its size on disk is recorded. Any
    exception turns the row into an error row carrying the message, never a number.
    """
    result = Result(size, key, label)
    try:
        for i in range(repeats):
            if before is not None:
                before(i)
            gc.collect()
            start = time.perf_counter()
            value = action(i)
            result.values.append(time.perf_counter() - start)
            if artifact is not None:
                result.nbytes = disk_bytes(artifact(i))
            if after is not None:
                after(i, value)
            del value
    except Exception as err:  # reported in the table, with what failed
        result.status = ERROR
        result.note = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        result.values = []
    return result


def disk_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        os.remove(path)
