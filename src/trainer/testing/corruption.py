"""A seeded corruption fuzzer for checkpoints (issue 36): damage copies of real checkpoints,
load each in a child process, and allow only a ``TrainerError`` or a load identical to the
original. Any backend can be fuzzed with it, built-in or third-party.

Save two consecutive checkpoints of one run (so that a file can be replaced by its
successor's) and the original's reference values (``corruption_models.write_reference``),
make a ``plan`` from a seed and run it with ``fuzz``. Each damage (``DAMAGES``) is a small
function that changes one random file of a checkpoint copy (two for ``swap``) and says what
it did. Outcomes: ``identical``, ``refused`` (a ``TrainerError`` naming the checkpoint or at
least saying that a checkpoint is at fault), and the failures ``unnamed`` (a ``TrainerError``
that does neither), ``error`` (any other exception), ``differs`` (not the original, bit for
bit), ``crash``, ``hang`` and ``not run`` (after too many of those). The damage is seeded;
the bytes it hits are not always the same ones, since checkpoints hold their creation time:
each damaged copy is kept for a re-run.

Design: a fresh process per *batch* of trials, not per trial. Importing TensorFlow costs
seconds and a load a tenth of one, so a process per trial would spend most of its time
starting. One child (``corruption_child``, run as a script) loads the copies in turn with
``load_checkpoint(path)``, the library's defaults unless ``load_options`` says otherwise, and
appends a JSON line to a results file before each load (``started``) and after it (the
outcome). The parent enforces a per-trial timeout. When the child dies or hangs, the trial
it had started and not finished is charged with the crash or hang (a hung child gets SIGABRT
first, and ``faulthandler`` prints where it was stuck), and a new child goes on with the
trials after it. The price: a trial may be affected by what earlier trials of its child left
behind (nothing is cleared in between: clearing Keras's session costs more than three loads),
so a failing trial is worth re-running alone (``fuzz([trial], ...)``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from trainer.testing import corruption_child

CONTROL = "none"  # a trial on an undamaged copy: only "identical" is allowed
ALLOWED = ("identical", "refused")
CHILD_MODULES = ("trainer.testing.corruption_models",)
LOADER = "trainer.save_backends:load_checkpoint"


# ------------------------------------------------------------------------- damages
def files_of(checkpoint: Path) -> list[Path]:
    """The files of a checkpoint, manifest included (a single-file checkpoint: itself)."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return [checkpoint]
    return sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.is_symlink())


def _pick(checkpoint: Path, rng: np.random.Generator, *, nonempty: bool = False) -> Path:
    files = [f for f in files_of(checkpoint) if f.stat().st_size or not nonempty]
    return files[int(rng.integers(len(files)))]


def _name(file: Path, checkpoint: Path) -> str:
    return file.name if file == checkpoint else file.relative_to(checkpoint).as_posix()


def flip(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Invert some bits of 1 to 8 random bytes of one file."""
    file = _pick(checkpoint, rng, nonempty=True)
    data = bytearray(file.read_bytes())
    count = min(int(rng.integers(1, 9)), len(data))
    offsets = sorted(int(i) for i in rng.choice(len(data), count, replace=False))
    for offset in offsets:
        data[offset] ^= int(rng.integers(1, 256))
    file.write_bytes(bytes(data))
    return f"{_name(file, checkpoint)}: bytes flipped at {offsets}"


def truncate(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Cut one file short, anywhere from nothing kept to one byte missing."""
    file = _pick(checkpoint, rng, nonempty=True)
    size = file.stat().st_size
    keep = int(rng.integers(size))
    os.truncate(file, keep)
    return f"{_name(file, checkpoint)}: truncated to {keep} of {size} bytes"


def zero(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Overwrite a block of 1 to 4096 bytes of one file with zeros (a lost disk sector)."""
    file = _pick(checkpoint, rng, nonempty=True)
    data = bytearray(file.read_bytes())
    length = int(rng.integers(1, min(len(data), 4096) + 1))
    start = int(rng.integers(len(data) - length + 1))
    data[start : start + length] = bytes(length)
    file.write_bytes(bytes(data))
    return f"{_name(file, checkpoint)}: bytes {start}-{start + length} of {len(data)} zeroed"


def delete(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Remove one file (a single-file checkpoint: the checkpoint itself)."""
    file = _pick(checkpoint, rng)
    file.unlink()
    return f"{_name(file, checkpoint)}: deleted"


def empty(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Leave one file in place with no content."""
    file = _pick(checkpoint, rng)
    file.write_bytes(b"")
    return f"{_name(file, checkpoint)}: emptied"


def append(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Add 1 to 1024 random bytes at the end of one file."""
    file = _pick(checkpoint, rng)
    garbage = rng.integers(0, 256, int(rng.integers(1, 1025)), dtype=np.uint8).tobytes()
    with open(file, "ab") as handle:
        handle.write(garbage)
    return f"{_name(file, checkpoint)}: {len(garbage)} bytes appended"


def swap(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Exchange the contents of two files of a directory checkpoint."""
    files = files_of(checkpoint)
    first, second = (files[int(i)] for i in rng.choice(len(files), 2, replace=False))
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)
    return f"{_name(first, checkpoint)} and {_name(second, checkpoint)}: swapped"


def replace(checkpoint: Path, rng: np.random.Generator, successor: Path | None = None) -> str:
    """Replace one file by the same file of the next checkpoint of the same run (a copy
    that mixed two checkpoints)."""
    if successor is None:
        raise ValueError("the 'replace' damage needs the successor checkpoint")
    names = {_name(f, successor) for f in files_of(successor)}
    files = [f for f in files_of(checkpoint) if _name(f, checkpoint) in names]
    file = files[int(rng.integers(len(files)))]
    same = file.read_bytes() == (Path(successor) / _name(file, checkpoint)).read_bytes()
    shutil.copyfile(Path(successor) / _name(file, checkpoint), file)
    return f"{_name(file, checkpoint)}: the next checkpoint's ({'same' if same else 'other'} bytes)"


DAMAGES: dict[str, Callable[..., str]] = {
    f.__name__: f for f in (flip, truncate, zero, delete, empty, append, swap, replace)
}
# A single-file checkpoint has no second file to swap with, and its successor's file is a
# whole valid checkpoint (of another step), not a damaged one.
DIRECTORY_ONLY = ("swap", "replace")


# ---------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class Trial:
    """One damaged copy to load; ``(seed, index)`` seeds the damage, so any trial of a plan
    can be made again on its own."""

    index: int
    seed: int
    backend: str
    model: str
    damage: str  # a key of DAMAGES, or CONTROL

    def __str__(self) -> str:
        return f"seed {self.seed} #{self.index} {self.backend}/{self.model} {self.damage}"


def plan(seed: int, count: int, backends: Iterable[str], models: Iterable[str]) -> list[Trial]:
    """One undamaged control per backend and model, then ``count`` damaged trials cycling
    through every (backend, model, damage) in an order drawn from ``seed``."""
    from trainer.save_backends import backend_class

    backends, models = list(backends), list(models)
    combos = [
        (b, m, d)
        for b, m, d in itertools.product(backends, models, DAMAGES)
        if backend_class(b).is_directory or d not in DIRECTORY_ONLY
    ]
    controls = list(itertools.product(backends, models))
    trials = [Trial(i, seed, b, m, CONTROL) for i, (b, m) in enumerate(controls)]
    rng = np.random.default_rng(seed)
    while len(trials) < len(controls) + count:
        for position in rng.permutation(len(combos)):
            trials.append(Trial(len(trials), seed, *combos[position]))
    return trials[: len(controls) + count]


def prepare(trial: Trial, original: Path, successor: Path, directory: Path) -> tuple[Path, str]:
    """A damaged copy of ``original`` for ``trial`` under ``directory``, and what was done."""
    target = Path(directory) / f"{trial.index:05d}" / Path(original).name
    target.parent.mkdir(parents=True)
    if Path(original).is_dir():
        shutil.copytree(original, target, symlinks=True)
    else:
        shutil.copyfile(original, target)
    if trial.damage == CONTROL:
        return target, "undamaged"
    rng = np.random.default_rng([trial.seed, trial.index])
    return target, DAMAGES[trial.damage](target, rng, successor=Path(successor))


# ---------------------------------------------------------------------------- runs
@dataclasses.dataclass
class Result:
    """A trial's outcome (see the module's docstring), with the damage done, the error,
    difference or end of the process (``detail``), and where the damaged copy is kept."""

    trial: Trial
    description: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    path: str = ""

    @property
    def bad(self) -> bool:
        allowed = ("identical",) if self.trial.damage == CONTROL else ALLOWED
        return self.outcome not in allowed

    def __str__(self) -> str:
        return f"{self.trial}: {self.description} -> {self.outcome}: {self.detail}"


Runs = dict[tuple[str, str], tuple[Path, Path, Path]]


def fuzz(trials: list[Trial], runs: Runs, directory: Path, **options: Any) -> list[Result]:
    """Prepare and load every trial; ``runs[backend, model]`` is ``(original, successor,
    reference)``. ``options`` go to ``run``."""
    jobs, described = {}, {}
    for trial in trials:
        original, successor, reference = runs[trial.backend, trial.model]
        path, described[trial.index] = prepare(trial, original, successor, Path(directory))
        jobs[trial.index] = {"index": trial.index, "path": str(path), "reference": str(reference)}
    outcomes = run(list(jobs.values()), Path(directory), **options)
    return [
        Result(t, described[t.index], path=jobs[t.index]["path"], **outcomes[t.index])
        for t in trials
    ]


def run(
    jobs: list[dict[str, Any]],
    directory: Path,
    *,
    timeout: float = 60.0,
    startup: float = 300.0,
    modules: Iterable[str] = CHILD_MODULES,
    loader: str = LOADER,
    load_options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    give_up: int = 8,
) -> dict[int, dict[str, Any]]:
    """Load ``jobs`` ({index, path, reference}) in child processes, a new one after each
    crash or hang (``timeout`` seconds for one trial, ``startup`` to import the modules);
    the outcome of each job by index. ``modules`` are imported by the child first (those
    that register the checkpoints' custom classes); ``loader`` ("module:function") is what
    it calls with each path and ``load_options``. After ``give_up`` crashes and hangs, the
    jobs left are ``not run``: each costs a new child, and a broken reader would hold CI."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    spec, results = Path(directory) / "jobs.json", Path(directory) / "results.jsonl"
    options = {"modules": list(modules), "loader": loader, "load_options": load_options or {}}
    spec.write_text(json.dumps({"jobs": jobs, **options}))
    results.touch()
    env = {**(os.environ if env is None else env), "TF_CPP_MIN_LOG_LEVEL": "3"}
    done: dict[int, dict[str, Any]] = {}
    while len(done) < len(jobs):
        start = next(i for i, job in enumerate(jobs) if job["index"] not in done)
        if sum(o["outcome"] in ("crash", "hang") for o in done.values()) >= give_up:
            skipped = {"outcome": "not run", "detail": f"gave up after {give_up} crashes/hangs"}
            done.update({job["index"]: dict(skipped) for job in jobs[start:]})
        else:
            _batch(spec, results, start, done, env, timeout=timeout, startup=startup)
    return done


def _batch(spec: Path, results: Path, start: int, done: dict, env, **limits: float) -> None:
    """One child from job ``start`` on, until it finishes, dies or hangs. A hung child gets
    SIGABRT first, so that ``faulthandler`` prints where it was stuck."""
    stderr = spec.with_name(f"child-{start:05d}.stderr")
    position = results.stat().st_size
    script = corruption_child.__file__
    command = [sys.executable, "-X", "faulthandler", script, str(spec), str(results), str(start)]
    with open(stderr, "wb") as err:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env)
    current, since, finished, hung = None, time.monotonic(), len(done), False
    while not hung:
        running = child.poll() is None  # before reading: an exit's last lines are read too
        events, position = _new_events(results, position)
        for event in events:
            current, since = event.pop("index"), time.monotonic()
            if event.pop("event") == "done":
                done[current], current = event, None
        if not running:
            break
        waiting = "startup" if len(done) == finished and current is None else "timeout"
        hung = time.monotonic() - since > limits[waiting]
        time.sleep(0.02)
    if hung:
        child.send_signal(signal.SIGABRT)
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
    code, said = child.wait(), _last_words(stderr)
    if current is not None:
        how = f"no outcome after {limits['timeout']:.0f} s" if hung else _exit(code)
        done[current] = {"outcome": "hang" if hung else "crash", "detail": f"{how}: {said}"}
    elif len(done) == finished:  # nothing happened: the fuzzer is broken, not the backend
        raise RuntimeError(f"the fuzzer's child process ran no trial ({_exit(code)}): {said}")


def _new_events(results: Path, position: int) -> tuple[list[dict[str, Any]], int]:
    """The complete lines written to ``results`` after ``position``, and the new position."""
    with open(results, "rb") as handle:
        handle.seek(position)
        chunk = handle.read()
    lines = chunk[: chunk.rfind(b"\n") + 1]
    return [json.loads(line) for line in lines.splitlines()], position + len(lines)


def _last_words(stderr: Path) -> str:
    """The Python stack ``faulthandler`` printed (innermost frames), else the last lines."""
    lines = [line.strip() for line in stderr.read_text(errors="replace").splitlines()]
    if any(line.startswith("Current thread") for line in lines):
        fatal = next((line for line in lines if line.startswith("Fatal Python error")), "")
        first = next(i for i, line in enumerate(lines) if line.startswith("Current thread"))
        frames = []
        for line in itertools.takewhile(bool, lines[first + 1 :]):
            file, _, rest = line.removeprefix('File "').partition('", line ')
            frames.append(f"{Path(file).name}:{rest.replace(' in ', ' ', 1)}")
        return f"{fatal} [{' < '.join(frames[:4])}]"
    return " | ".join([line for line in lines if line][-3:])


def _exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# -------------------------------------------------------------------------- report
def summary(results: list[Result]) -> str:
    """Outcome counts per backend and damage, then every bad trial on a line of its own."""
    counts = collections.Counter((r.trial.backend, r.trial.damage, r.outcome) for r in results)
    lines = [f"{len(results)} trials"]
    lines += [f"  {b:<11} {d:<9} {o:<10} {n}" for (b, d, o), n in sorted(counts.items())]
    bad = [r for r in results if r.bad]
    lines += [f"{len(bad)} bad trials:"] + [f"  {r}\n    (the copy: {r.path})" for r in bad]
    return "\n".join(lines)
