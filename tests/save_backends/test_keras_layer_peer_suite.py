"""Keras 3's own layer tests as a peer suite: every layer they test, after Keras's checks
pass, saved and loaded through each trainer backend and compared with the original
(``tests/peer/layer_routing_plugin.py``, ``tests/peer/layer_round_trip.py``).

Each call of ``run_layer_test`` with an input is a *case*; per run (``savedmodel``, ``h5``,
``weights``: a Functional wrapper, classes available; ``savedmodel-revived``: a subclassed
wrapper, it and the Keras test modules' Layer classes hidden at load) a case is

* ``identical``: weights (count, order, paths, shapes, values), the revived layer's class,
  outputs on the test's input and one training step all match;
* ``silent``: the load succeeded but something differs (the worst kind);
* ``loud``: trainer's save or load raised, or the loaded model failed where the original
  worked;
* ``not_applicable``: with a rule; ``not_applicable_rules`` in the expectations give the
  reasons of the rules that hold for any case, the other rules need the case listed.

``tests/peer/layer_expectations.json`` lists every case that is not identical, per run,
with its outcome, a reason, the issue that tracks it and a fragment its detail must hold.
A listed case that becomes identical, or fails another way, fails here until the file is
updated.

The default run routes a small fixed subset (``smoke`` in the expectations: under a minute
of worker time); the whole of ``keras.src.layers`` runs with ``TRAINER_LAYER_PEER=full``,
the modules ``TRAINER_LAYER_PEER_MODULES`` names (comma-separated) with it set too.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.peer import child_runs

PEER_DIR = ROOT / "tests" / "peer"
EXPECTATIONS = PEER_DIR / "layer_expectations.json"
RUNS = ("savedmodel", "h5", "weights", "savedmodel-revived")
OUTCOMES = ("identical", "silent", "loud", "not_applicable")
FULL = os.environ.get("TRAINER_LAYER_PEER") == "full"
# With FULL: only these comma-separated ``--pyargs`` names (Keras test modules, or
# ``module::Class::test``), instead of the whole of ``keras.src.layers``.
MODULES = [m.strip() for m in os.environ.get("TRAINER_LAYER_PEER_MODULES", "").split(",")]
CHILD_TIMEOUT = 600 if not FULL else 4 * 3600


def load_expectations() -> dict:
    return json.loads(EXPECTATIONS.read_text())


def run_child(selection: list[str], runs: list[str], workdir: Path) -> tuple[dict, float, str]:
    """Run the Keras layer tests ``selection`` (``--pyargs`` names) in a child pytest with
    the routing plugin; return (report, seconds, log tail)."""
    report_path = workdir / "layers.json"
    env = {
        "TRAINER_LAYER_PEER_BACKENDS": ",".join(runs),
        "TRAINER_LAYER_PEER_REPORT": str(report_path),
    }
    return child_runs.run_child(
        "layer_routing_plugin",
        selection,
        workdir,
        env=env,
        report_path=report_path,
        timeout=CHILD_TIMEOUT,
    )


def classify(report: dict, expectations: dict) -> tuple[dict, list[str]]:
    """Count the report's cases per run and outcome; list every mismatch with the file."""
    counts = {run: dict.fromkeys(OUTCOMES, 0) for run in report["runs"]}
    problems: list[str] = []
    rules = expectations.get("not_applicable_rules", {})
    used: set[tuple[str, str]] = set()
    for key, case in sorted(report["cases"].items()):
        for run, record in case["runs"].items():
            outcome = record["outcome"]
            counts[run][outcome] += 1
            pattern, entry = child_runs.lookup(expectations["runs"][run], key)
            if pattern is not None:
                used.add((run, pattern))
            if outcome == "identical":
                if pattern is not None:
                    problems.append(
                        f"[{run}] {key}: listed as {entry['outcome']} but identical now"
                    )
                continue
            if outcome == "not_applicable" and record["rule"] in rules and pattern is None:
                continue
            if pattern is None:
                problems.append(
                    f"[{run}] {key} ({case['layer']}): {outcome} and not listed in "
                    f"{EXPECTATIONS.name}:\n    {record.get('detail', '')[:700]}"
                )
            elif entry["outcome"] != outcome or entry["match"] not in record.get("detail", ""):
                problems.append(
                    f"[{run}] {key}: listed as {entry['outcome']} with {entry['match']!r}, "
                    f"but {outcome}:\n    {record.get('detail', '')[:700]}"
                )
    for key, test in sorted(report["tests"].items()):
        if (
            test.get("outcome") == "failed"
            and child_runs.lookup(expectations.get("keras_failures", {}), key)[0] is None
        ):
            problems.append(f"{key}: Keras's own test failed in the child: {test.get('message')}")
    # Stale entries: a pattern must match a case of the tests this run executed (a run
    # of a few tests, the smoke subset, leaves the other entries alone).
    tests = list(report["tests"])
    for run in report["runs"]:
        for pattern in expectations["runs"][run]:
            ran = any(fnmatch.fnmatchcase(t, pattern.split("#")[0]) for t in tests)
            if ran and (run, pattern) not in used:
                problems.append(f"[{run}] entry {pattern!r} matches no case that ran")
    return counts, problems


def _table(report: dict, counts: dict, seconds: float) -> str:
    lines = [
        f"keras {report['keras_version']}: {len(report['cases'])} cases, child {seconds:.0f}s "
        f"(Keras's own checks {report['keras_seconds']}s, {report['deselected']} tests deselected)"
    ]
    for run, by in counts.items():
        lines.append(
            f"  {run:20} "
            + ", ".join(f"{by[o]} {o}" for o in OUTCOMES)
            + f"  ({report['run_seconds'].get(run, 0)}s)"
        )
    return "\n".join(lines)


def test_expectations_are_well_formed():
    expectations = load_expectations()
    assert set(expectations["runs"]) == set(RUNS)
    for rule, reason in expectations["not_applicable_rules"].items():
        assert reason, rule
    for run, table in expectations["runs"].items():
        for pattern, entry in table.items():
            where = f"{run} {pattern}"
            assert entry.get("outcome") in OUTCOMES[1:], where
            assert entry.get("reason") and entry.get("match"), where
            if entry["outcome"] != "not_applicable":
                assert entry.get("issue") in (38, 42), f"{where}: cite issue 38 or 42"


def _compared(report: dict, run: str) -> int:
    """The cases of ``run`` that were saved, loaded and compared: any outcome but a
    not-applicable one decided before routing (a case whose differences all are Keras's
    own round trip's, ``keras_round_trip_too``, was compared)."""
    return sum(
        1
        for case in report["cases"].values()
        if case["runs"][run]["outcome"] != "not_applicable"
        or case["runs"][run].get("rule") == "keras_round_trip_too"
    )


def _check(selection: list[str], tmp_path: Path, capsys, min_cases: int) -> None:
    expectations = load_expectations()
    report, seconds, log = run_child(selection, list(RUNS), tmp_path)
    counts, problems = classify(report, expectations)
    with capsys.disabled():
        print("\n[layer peer] " + _table(report, counts, seconds))
    assert report["runs"] == list(RUNS)
    # Routing reached trainer: cases were made and compared, in every run.
    assert len(report["cases"]) >= min_cases, f"{len(report['cases'])} cases:\n{log}"
    for run in RUNS:
        assert _compared(report, run) > 0, f"{run}: no case saved, loaded and compared\n{log}"
    assert not problems, f"{len(problems)} mismatch(es) with {EXPECTATIONS.name}:\n" + "\n".join(
        problems
    )


@pytest.mark.slow
def test_keras_layer_tests_smoke_subset(tmp_path, capsys):
    """The fixed subset in ``smoke``: a few layer kinds through every run."""
    smoke = load_expectations()["smoke"]
    _check(smoke["tests"], tmp_path, capsys, min_cases=smoke["min_cases"])


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the whole layer suite: set TRAINER_LAYER_PEER=full")
def test_keras_layer_tests_full(tmp_path, capsys):
    """The whole suite, or the modules ``TRAINER_LAYER_PEER_MODULES`` names."""
    selection = [m for m in MODULES if m]
    if selection:
        _check(selection, tmp_path, capsys, min_cases=1)
    else:
        _check(["keras.src.layers"], tmp_path, capsys, min_cases=400)


# ------------------------------------------------------- the classifier on made-up reports
KEY = "keras.src.layers.core.dense_test::DenseTest::test_dense_basics#1"


def _report(record: dict, test_outcome: str = "passed") -> dict:
    return {
        "runs": ["h5"],
        "cases": {KEY: {"layer": "keras.src.layers.core.dense.Dense", "runs": {"h5": record}}},
        "tests": {KEY.split("#")[0]: {"outcome": test_outcome, "cases": 1}},
    }


def _expect(entries: dict | None = None, rules: dict | None = None) -> dict:
    runs = {run: {} for run in RUNS}
    runs["h5"] = entries or {}
    return {"runs": runs, "not_applicable_rules": rules or {}, "keras_failures": {}}


def _listed(outcome: str, match: str) -> dict:
    return {"outcome": outcome, "reason": "r", "match": match, "issue": 42}


SILENT = {"outcome": "silent", "detail": "outputs[0] differs: float32[2, 3]"}
LOUD = {"outcome": "loud", "detail": "load: MissingClassError: class Dense not found"}
NA = {"outcome": "not_applicable", "rule": "no_input", "detail": ""}


@pytest.mark.parametrize(
    ("record", "expect", "problem"),
    [
        ({"outcome": "identical"}, _expect(), None),
        (SILENT, _expect(), "not listed"),
        (SILENT, _expect({KEY: _listed("silent", "outputs[0] differs")}), None),
        (SILENT, _expect({KEY: _listed("loud", "outputs[0] differs")}), "but silent"),
        (LOUD, _expect({"*dense_test*": _listed("loud", "other text")}), "but loud"),
        ({"outcome": "identical"}, _expect({KEY: _listed("loud", "x")}), "identical now"),
        (NA, _expect(rules={"no_input": "why"}), None),
        (NA, _expect(), "not listed"),
    ],
)
def test_classify(record, expect, problem):
    counts, problems = classify(_report(record), expect)
    assert counts["h5"][record["outcome"]] == 1
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_classify_reports_stale_entries_and_keras_failures():
    expect = _expect({KEY.replace("#1", "#2"): _listed("loud", "x")})
    _, problems = classify(_report({"outcome": "identical"}, test_outcome="failed"), expect)
    assert len(problems) == 2, problems
    assert any("matches no case" in p for p in problems)
    assert any("Keras's own test failed" in p for p in problems)
