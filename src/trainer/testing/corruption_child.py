"""The corruption fuzzer's child process: loads damaged checkpoint copies one after the other
and records each outcome (``trainer.testing.corruption`` starts it and reads the records).

Run as a script, by path: ``python corruption_child.py JOBS RESULTS START``. Not with -m:
importing the ``trainer.testing`` package imports TensorFlow, which a child loading with a
stand-in loader never needs. Before each load it appends ``{"index", "event": "started"}``
to RESULTS, after it ``{"index", "event": "done", "outcome", "detail", "seconds"}``, each
line flushed at once: a trial started and never done is the one that killed or hung it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main(spec_file: str, results_file: str, start: int) -> None:
    spec = json.loads(Path(spec_file).read_text())
    for module in spec["modules"]:
        importlib.import_module(module)
    module, _, name = spec["loader"].partition(":")
    loader = getattr(importlib.import_module(module), name)
    with open(results_file, "a") as results:
        for job in spec["jobs"][start:]:
            _record(results, {"index": job["index"], "event": "started"})
            begun = time.perf_counter()
            outcome = load_one(loader, job["path"], job["reference"], spec["load_options"])
            outcome["seconds"] = round(time.perf_counter() - begun, 3)
            _record(results, {"index": job["index"], "event": "done", **outcome})


def _record(results, event: dict[str, Any]) -> None:
    results.write(json.dumps(event) + "\n")
    results.flush()


def load_one(
    loader: Callable[..., Any], path: str, reference: str, load_options: dict[str, Any]
) -> dict[str, Any]:
    """Load one damaged copy in this process and judge it against ``reference``."""
    from trainer.errors import TrainerError

    try:
        checkpoint = loader(path, **load_options)
    except TrainerError as error:
        named = Path(path).name in str(error) or "checkpoint" in str(error)
        return {"outcome": "refused" if named else "unnamed", "detail": _describe(error)}
    except BaseException as error:  # anything else is a failure, KeyboardInterrupt aside
        if isinstance(error, KeyboardInterrupt):
            raise
        return {"outcome": "error", "detail": _describe(error, frames=True)}
    try:
        from trainer.testing.corruption_models import compare

        difference = compare(checkpoint, reference)
    except Exception as error:  # a model that cannot even be compared is not the original
        difference = f"comparing it raised {_describe(error, frames=True)}"
    return {"outcome": "differs" if difference else "identical", "detail": difference or ""}


def _describe(error: BaseException, *, frames: bool = False) -> str:
    """Type and message; with ``frames``, where it was raised and the last trainer frames."""
    text = f"{type(error).__name__}: {str(error)[:400]}"
    if frames:
        stack = traceback.extract_tb(error.__traceback__)
        ours = [f for f in stack[:-1] if f"{os.sep}trainer{os.sep}" in f.filename][-2:]
        where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in [*ours, *stack[-1:]]]
        text += f" [{' < '.join(reversed(where))}]"
    return text


if __name__ == "__main__":
    # Run by path: this directory comes first on sys.path, and holds no top-level modules
    # (its models.py is no `models`).
    del sys.path[0]
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
