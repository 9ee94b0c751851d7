"""Issue 36, part 3: the corruption fuzzer (``trainer.testing.corruption``) over the built-in
backends. Real checkpoints of three small trained models get random damage to random files;
each damaged copy is loaded in a child process and must be refused with a ``TrainerError`` or
load identical to the original (outputs, weights, optimizer state, training state).

Seeded: CI runs ``TRAINER_FUZZ_TRIALS`` damaged trials (300 by default; one plan, each
backend's test runs its share, h5 fewer: a single file cannot be swapped or replaced) from
``TRAINER_FUZZ_SEED`` (36), plus an undamaged control per backend and model. Set them for a
longer or another run: a trial costs about a tenth of a second, each test's fixed part (its
models, and a child importing TensorFlow) some twenty. ``TRAINER_FUZZ_VERIFY=1`` (or ``0``)
loads with ``verify=True`` (``False``) instead of the library's default: with digests checked
first, what still fails is a reader's own defect; without, the readers face the damage.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers.processes import subprocess_env
from trainer.save_backends import backend_class
from trainer.testing import corruption
from trainer.testing.corruption_models import FUZZ_MODELS, save_run

BACKENDS = ("savedmodel", "h5", "weights")
TRIALS = int(os.environ.get("TRAINER_FUZZ_TRIALS", "300"))
SEED = int(os.environ.get("TRAINER_FUZZ_SEED", "36"))
VERIFY = os.environ.get("TRAINER_FUZZ_VERIFY", "")
LOAD_OPTIONS = {"verify": VERIFY == "1"} if VERIFY in ("0", "1") else {}
TIMEOUT = 20  # seconds for one load: a hundred times what one takes


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> dict[str, tuple[list, list]]:
    """``backend -> (its trials, their results)``: every backend's trials loaded by ONE
    child process (a child per backend only added a TensorFlow import each)."""
    root = tmp_path_factory.mktemp("fuzz")
    trials = corruption.plan(SEED, TRIALS, BACKENDS, FUZZ_MODELS)
    runs = {
        (backend, kind): save_run(backend, kind, root / "runs" / backend)
        for backend in BACKENDS
        for kind in FUZZ_MODELS
    }
    results = corruption.fuzz(
        trials,
        runs,
        root / "trials",
        timeout=TIMEOUT,
        env=subprocess_env(),
        load_options=LOAD_OPTIONS,
        give_up=8 * len(BACKENDS),  # the crashes and hangs each backend's own child allowed
    )
    return {
        backend: (
            [t for t in trials if t.backend == backend],
            [r for r in results if r.trial.backend == backend],
        )
        for backend in BACKENDS
    }


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_checkpoints_are_refused_or_load_identical(backend, fuzzed):
    trials, results = fuzzed[backend]
    print(corruption.summary(results))  # the tally: shown with ``pytest -rP``
    assert len(results) == len(trials)
    assert any(r.outcome == "refused" for r in results), "no damage was ever noticed"
    bad = [r for r in results if r.bad]
    if bad:
        pytest.fail(
            f"{len(bad)} of {len(results)} damaged {backend} checkpoints were neither refused "
            f"with a TrainerError nor loaded identical (load options {LOAD_OPTIONS}; trial #i "
            f"is corruption.plan({SEED}, {TRIALS}, {BACKENDS}, {FUZZ_MODELS})[i]):\n"
            f"{corruption.summary(results)}",
            pytrace=False,
        )


# ------------------------------------------------------------------ the engine itself
@pytest.fixture
def pair(tmp_path):
    """A small directory "checkpoint" of random bytes and its successor (other bytes)."""
    rng = np.random.default_rng(0)
    made = []
    for name in ("first", "second"):
        root = tmp_path / name
        (root / "sub").mkdir(parents=True)
        for file in ("index.json", "sub/data.bin", "trainer_manifest.json"):
            (root / file).write_bytes(rng.integers(1, 256, 600, dtype=np.uint8).tobytes())
        made.append(root)
    return made


def contents(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in corruption.files_of(root)}


@pytest.mark.parametrize("damage", sorted(corruption.DAMAGES))
def test_each_damage_changes_the_checkpoint_and_says_where(damage, pair):
    checkpoint, successor = pair
    before = contents(checkpoint)
    description = corruption.DAMAGES[damage](
        checkpoint, np.random.default_rng(1), successor=successor
    )
    after = contents(checkpoint)
    changed = sorted(f for f in before if after.get(f) != before[f])
    assert changed and all(f in description for f in changed), (description, changed)
    sizes = {f: (len(before[f]), len(after.get(f, b""))) for f in changed}
    if damage in ("flip", "zero", "swap", "replace"):
        assert all(old == new for old, new in sizes.values()), sizes
    elif damage == "truncate":
        ((old, new),) = sizes.values()
        assert new < old and f"to {new} of {old} bytes" in description
    elif damage == "append":
        (file,) = changed
        assert after[file].startswith(before[file]) and len(after[file]) > len(before[file])
    elif damage == "delete":
        assert set(after) == set(before) - set(changed)
    elif damage == "empty":
        assert [after[f] for f in changed] == [b""]
    if damage == "replace":
        assert after[changed[0]] == contents(successor)[changed[0]]
    if damage == "swap":
        first, second = changed
        assert (after[first], after[second]) == (before[second], before[first])


def test_damage_and_plan_are_seeded(pair, tmp_path):
    checkpoint, successor = pair
    copies = [tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt"]
    descriptions = []
    for copy in copies:
        trial = corruption.Trial(7, 99, "weights", "batchnorm", "flip")
        path, description = corruption.prepare(trial, checkpoint, successor, copy.parent)
        descriptions.append((description, contents(path)))
    assert descriptions[0] == descriptions[1]
    assert contents(checkpoint) != descriptions[0][1], "prepare damaged the original"

    trials = corruption.plan(5, 200, BACKENDS, FUZZ_MODELS)
    assert trials == corruption.plan(5, 200, BACKENDS, FUZZ_MODELS)
    assert trials != corruption.plan(6, 200, BACKENDS, FUZZ_MODELS)
    controls = len(BACKENDS) * len(FUZZ_MODELS)
    assert len(trials) == 200 + controls and [t.index for t in trials] == list(range(len(trials)))
    assert {t.damage for t in trials[:controls]} == {corruption.CONTROL}
    damaged = {(t.backend, t.model, t.damage) for t in trials[controls:]}
    for backend in BACKENDS:
        kinds = {d for b, _, d in damaged if b == backend}
        single_file = not backend_class(backend).is_directory
        expected = set(corruption.DAMAGES) - set(corruption.DIRECTORY_ONLY if single_file else ())
        assert kinds == expected, backend


@pytest.mark.slow
def test_runner_charges_crashes_and_hangs_to_the_trial_and_goes_on(tmp_path):
    names = ["refused-0", "crash-1", "raise-2", "hang-3"]  # a second child after the crash
    jobs = [{"index": i, "path": str(tmp_path / n), "reference": ""} for i, n in enumerate(names)]
    stand_in = "fuzz_faults:load_checkpoint"
    outcomes = corruption.run(
        jobs,
        tmp_path,
        timeout=3,
        modules=[],
        loader=stand_in,
        load_options={"verify": True},
        env=subprocess_env(),
    )
    got = [outcomes[i]["outcome"] for i in range(len(names))]
    assert got == ["refused", "crash", "error", "hang"], outcomes
    assert "{'verify': True}" in outcomes[0]["detail"], "load options did not reach the child"
    assert "SIGABRT" in outcomes[1]["detail"] and "fuzz_faults.py" in outcomes[1]["detail"]
    assert "AttributeError: a bug while loading raise-2" in outcomes[2]["detail"]
    hang = outcomes[3]["detail"]
    assert "no outcome after 3 s" in hang and "load_checkpoint" in hang, "not where it hung"

    crash_first = [jobs[1], jobs[0]]
    given_up = corruption.run(
        crash_first,
        tmp_path / "again",
        give_up=1,
        modules=[],
        loader=stand_in,
        env=subprocess_env(),
    )
    assert given_up[1]["outcome"] == "crash" and given_up[0]["outcome"] == "not run", given_up
