"""Keras 3's own saving tests, run from the installed ``keras`` package with Keras's
save/load routed through each trainer backend (``tests/peer/routing_plugin.py``).

The savedmodel backend also runs Keras's SavedModel export suite
(``keras.src.export.saved_model_test``), with ``export_saved_model`` / ``Model.export``
routed to its save: the other backends write no SavedModel, so it would be all N/A there.

All runs share ONE child pytest (TensorFlow, Keras and the Keras test modules are
imported once; the plugin switches its routing to each run's backend and runs that run's
tests, run after run); the plugin reports per run and test whether trainer's save/load was
reached. A test that reached no backend, with fall-throughs its arguments alone decided, is
run in the first run only: the later runs would run the same Keras code with the same
routing, and take its entry (``carried_from``). A Keras test is

* *not applicable* if it never reached trainer or ``tests/peer/expectations.json`` lists
  it as such (assertions about ``.keras`` zip internals, BytesIO targets, Keras's own
  argument checks and error texts, Keras-only APIs such as ``load_weights``);
* a *known failure* if the expectations list it for the backend: a trainer defect
  tracked by issue 14, which must still fail with the recorded message fragment;
* otherwise it must pass.

Every entry in the expectations must still match something, so fixing a defect (a known
failure that passes) or a routing change (an N/A test that now reaches trainer, or the
reverse) fails here until the file is updated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.peer import child_runs

PEER_DIR = ROOT / "tests" / "peer"
EXPECTATIONS = PEER_DIR / "expectations.json"
BACKENDS = ("savedmodel", "h5", "weights")
# Each run: (backend, revive). "savedmodel-revived" runs the export suite again, with
# every export opened as trainer revives it, the test modules' classes unregistered.
RUNS = {
    "savedmodel": ("savedmodel", False),
    "h5": ("h5", False),
    "weights": ("weights", False),
    "savedmodel-revived": ("savedmodel", True),
}
CHILD_TIMEOUT = 3000  # seconds for all runs; a normal child takes a few minutes on 2 cores


def load_expectations() -> dict:
    return json.loads(EXPECTATIONS.read_text())


def suites_of(run: str, expectations: dict) -> list[str]:
    """The Keras test modules a run executes: its own ``suites`` if it lists them,
    otherwise the shared ones plus its ``extra_suites``."""
    spec = expectations["backends"][run]
    if "suites" in spec:
        return list(spec["suites"])
    return [*expectations["suites"], *spec.get("extra_suites", [])]


def run_suites(runs: list[str], workdir: Path, expectations: dict) -> tuple[dict, float, str]:
    """Run the Keras suites of ``runs`` in ONE child pytest (TensorFlow, Keras and the
    test modules imported once), run after run; return (report, seconds, log)."""
    report_path = workdir / "peer.json"
    specs = {
        run: {
            "backend": RUNS[run][0],
            "revive": RUNS[run][1],
            "suites": suites_of(run, expectations),
        }
        for run in runs
    }
    selection = sorted({suite for spec in specs.values() for suite in spec["suites"]})
    env = {"TRAINER_PEER_RUNS": json.dumps(specs), "TRAINER_PEER_REPORT": str(report_path)}
    deselected = sorted(expectations.get("deselect", {}))
    extra = ["-k", " and ".join(f"not {name}" for name in deselected)] if deselected else []
    return child_runs.run_child(
        "routing_plugin",
        selection,
        workdir,
        env=env,
        report_path=report_path,
        timeout=CHILD_TIMEOUT,
        extra_args=extra,
    )


def classify(report: dict, expectations: dict, backend: str) -> tuple[dict, list[str]]:
    """Sort the report's tests into passed / known_failure / not_applicable; and problems."""
    spec = expectations["backends"][backend]
    shared_na = expectations.get("not_applicable", {})
    backend_na = spec.get("not_applicable", {})
    known = spec.get("known_failures", {})
    groups: dict[str, list[str]] = {"passed": [], "known_failure": [], "not_applicable": []}
    problems: list[str] = []

    for key, entry in sorted(report["tests"].items()):
        na_pattern, na = child_runs.lookup(backend_na, key)
        if na_pattern is None:
            na_pattern, na = child_runs.lookup(shared_na, key)
        kf_pattern, kf = child_runs.lookup(known, key)
        outcome, message = entry["outcome"], entry.get("message", "")
        # The message, and the source lines along the traceback (which assertion failed).
        evidence = "\n".join([message, *entry.get("failing_lines", [])])

        if na_pattern is not None and kf_pattern is not None:
            problems.append(f"{key}: listed both as not applicable and as a known failure")
            continue
        if not entry["reached_trainer"]:
            groups["not_applicable"].append(key)
            if kf_pattern is not None:
                problems.append(
                    f"{key}: listed as a known failure but never reached trainer ({outcome})"
                )
            elif na_pattern is None:
                problems.append(
                    f"{key}: never reached trainer ({outcome}; {entry.get('calls')}) and is not "
                    f"listed as not applicable: list it with a reason, or fix the routing"
                )
            continue
        if na_pattern is not None:
            groups["not_applicable"].append(key)
            fragment = na.get("match") if isinstance(na, dict) else None
            if outcome == "failed" and fragment and fragment not in evidence:
                problems.append(
                    f"{key}: not applicable only where it fails on {fragment!r}, but it fails "
                    f"elsewhere:\n    {evidence[:900]}"
                )
            continue
        if outcome == "skipped":
            groups["not_applicable"].append(key)
            continue
        if outcome == "passed":
            groups["passed"].append(key)
            if kf_pattern is not None:
                problems.append(
                    f"{key}: listed as a known failure (issue 14) but passes now: "
                    f"remove it from {EXPECTATIONS.name}"
                )
            continue
        # failed
        if kf_pattern is None:
            problems.append(
                f"{key}: FAILED and not listed as a known failure:\n    {message[:600]}\n"
                f"    trainer errors: {entry.get('trainer_errors')}"
            )
            groups["known_failure"].append(key)  # counted as failed in the table
            continue
        fragment = kf["match"]
        if fragment not in evidence:
            problems.append(
                f"{key}: known failure now fails differently; expected {fragment!r} in:\n"
                f"    {evidence[:900]}"
            )
        groups["known_failure"].append(key)

    # Stale entries: each must name a test of the modules this run executed (a run with
    # its own ``suites`` skips the shared entries about the other modules).
    modules = {key.split("::")[0] for key in report["tests"]}
    for scope, table in (("not_applicable", shared_na), (backend, {**backend_na, **known})):
        for pattern in table:
            if scope == "not_applicable" and pattern.split("::")[0] not in modules:
                continue
            if not any(child_runs.lookup({pattern: True}, key)[0] for key in report["tests"]):
                problems.append(f"{scope} entry {pattern!r} matches no test that ran")
    return groups, problems


def test_expectations_are_well_formed():
    expectations = load_expectations()
    assert set(expectations["backends"]) == set(RUNS)
    for backend, spec in expectations["backends"].items():
        for key, entry in spec.get("known_failures", {}).items():
            assert entry.get("issue") == 14, f"{backend} {key}: known failures track issue 14"
            assert entry.get("reason") and entry.get("match"), f"{backend} {key}"
        for key, entry in spec.get("not_applicable", {}).items():
            assert _reason(entry), f"{backend} {key}: needs a reason"
    for key, entry in expectations.get("not_applicable", {}).items():
        assert _reason(entry), f"{key}: needs a reason"


def _reason(entry) -> str:
    return entry if isinstance(entry, str) else entry.get("reason", "")


@pytest.mark.slow
def test_keras_saving_suites_through_every_backend(tmp_path, capsys):
    """Every run (``RUNS``) in one child; each run's tests classified against the
    expectations, every mismatch of every run reported together."""
    expectations = load_expectations()
    report, seconds, log = run_suites(list(RUNS), tmp_path, expectations)
    assert "keras.Model.save" in report["patched"], report["patched"]
    assert "tf.saved_model.load" in report["patched"], report["patched"]  # the revived run
    assert sorted(report["runs"]) == sorted(RUNS), f"runs missing from the report:\n{log}"
    problems: list[str] = []
    for run, (backend, revive) in RUNS.items():
        result = report["runs"][run]
        assert (result["backend"], result["revive"]) == (backend, revive), run
        assert result["tests"], f"{run}: no test ran\n{log}"
        groups, found = classify(result, expectations, run)
        problems += [f"[{run}] {problem}" for problem in found]
        reached = sum(entry["reached_trainer"] for entry in result["tests"].values())
        carried = sum("carried_from" in entry for entry in result["tests"].values())
        with capsys.disabled():
            print(
                f"\n[peer {run}] keras {report['keras_version']}: "
                f"{len(groups['passed'])} passed, {len(groups['known_failure'])} failed, "
                f"{len(groups['not_applicable'])} not applicable "
                f"({len(result['tests'])} run, {reached} reached trainer, {carried} carried over "
                f"from an earlier run, "
                f"{len(expectations.get('deselect', {}))} patterns deselected) "
                f"in {result['seconds']:.0f}s of the child's {seconds:.0f}s"
            )
    assert not problems, (
        f"{len(problems)} mismatch(es) with {EXPECTATIONS.name}:\n"
        + "\n".join(problems)
        + f"\n--- child log tail ---\n{log[-3000:]}"
    )


# ------------------------------------------------------- the classifier on made-up reports
KEY = "keras.src.saving.saving_lib_test::SavingTest::test_{}"


def _entry(outcome="passed", reached=True, message="", lines=()):
    return {
        "outcome": outcome,
        "reached_trainer": reached,
        "message": message,
        "failing_lines": list(lines),
        "calls": [],
        "trainer_errors": [],
    }


def _expect(na=None, known=None, shared=None):
    backends = {b: {"not_applicable": {}, "known_failures": {}} for b in BACKENDS}
    backends["h5"] = {"not_applicable": na or {}, "known_failures": known or {}}
    return {"not_applicable": shared or {}, "backends": backends}


def _known(match):
    return {"issue": 14, "reason": "r", "match": match}


@pytest.mark.parametrize(
    ("entry", "expect", "group", "problem"),
    [
        (_entry(), _expect(), "passed", None),
        (_entry("failed", message="AssertionError: x"), _expect(), "known_failure", "not listed"),
        (
            _entry("failed", message="TypeError: y", lines=["self.assertTrue(m.built)"]),
            _expect(known={KEY.format("a"): _known("m.built")}),
            "known_failure",
            None,
        ),
        (_entry(), _expect(known={KEY.format("a"): _known("x")}), "passed", "passes now"),
        (
            _entry("failed", message="OtherError"),
            _expect(known={KEY.format("*"): _known("TypeError")}),
            "known_failure",
            "fails differently",
        ),
        (_entry(reached=False), _expect(), "not_applicable", "never reached trainer"),
        (_entry(reached=False), _expect(shared={KEY.format("a"): "why"}), "not_applicable", None),
        (
            _entry(reached=False),
            _expect(known={KEY.format("a"): _known("x")}),
            "not_applicable",
            "never reached",
        ),
        (
            _entry("failed", message="ValueError"),
            _expect(na={KEY.format("a"): {"reason": "why", "match": "os.remove("}}),
            "not_applicable",
            "fails elsewhere",
        ),
        (_entry("skipped"), _expect(), "not_applicable", None),
    ],
)
def test_classify(entry, expect, group, problem):
    groups, problems = classify({"tests": {KEY.format("a"): entry}}, expect, "h5")
    assert KEY.format("a") in groups[group]
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_classify_reports_stale_entries():
    expect = _expect(known={KEY.format("gone"): _known("x")}, shared={KEY.format("old*"): "why"})
    _, problems = classify({"tests": {KEY.format("a"): _entry()}}, expect, "h5")
    assert len(problems) == 2 and all("matches no test" in p for p in problems), problems


# ------------------------------------------- the plugin's runs, on a module of its own
RUNS_MODULE = """
import io
import keras
import numpy as np


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model(np.zeros((1, 3), "float32"))
    return model


def test_reaches(tmp_path):
    path = str(tmp_path / "m.keras")
    keras.saving.save_model(_model(), path)
    keras.saving.load_model(path)


def test_to_a_file_object():
    keras.saving.save_model(_model(), io.BytesIO())


def test_loads_a_file_keras_wrote(tmp_path):
    path = str(tmp_path / "m.weights.h5")
    model = _model()
    model.save_weights(path)
    try:  # Keras refuses a weights file as a model: the outcome does not matter here
        keras.saving.load_model(path)
    except Exception:
        pass
"""


@pytest.mark.slow
def test_runs_share_one_child_and_carry_over_what_never_reaches_a_backend(tmp_path):
    """Two runs in one child: each run's tests reach its own backend; a test whose only
    fall-through its arguments decided (a BytesIO target) runs in the first run only and
    is carried over; one a backend's reader decided (a file Keras wrote) runs in both."""
    (tmp_path / "peer_runs_probe_test.py").write_text(RUNS_MODULE)
    specs = {
        "h5": {"backend": "h5", "revive": False, "suites": ["peer_runs_probe_test"]},
        "weights": {"backend": "weights", "revive": False, "suites": ["peer_runs_probe_test"]},
    }
    report_path = tmp_path / "report.json"
    env = {"TRAINER_PEER_RUNS": json.dumps(specs), "TRAINER_PEER_REPORT": str(report_path)}
    report, _, log = child_runs.run_child(
        "routing_plugin",
        [str(tmp_path / "peer_runs_probe_test.py")],
        tmp_path,
        env=env,
        report_path=report_path,
        timeout=CHILD_TIMEOUT,
    )
    key = "peer_runs_probe_test::{}".format
    first, second = report["runs"]["h5"]["tests"], report["runs"]["weights"]["tests"]
    assert (
        set(first)
        == set(second)
        == {
            key("test_reaches"),
            key("test_to_a_file_object"),
            key("test_loads_a_file_keras_wrote"),
        }
    ), log
    for run, tests in (("h5", first), ("weights", second)):
        reached = tests[key("test_reaches")]
        assert reached["outcome"] == "passed" and reached["saves"] == 1, (run, reached, log)
        assert "carried_from" not in reached
    assert not first[key("test_to_a_file_object")]["reached_trainer"]
    assert second[key("test_to_a_file_object")]["carried_from"] == "h5"
    for tests in (first, second):
        keras_wrote = tests[key("test_loads_a_file_keras_wrote")]
        assert keras_wrote["backend_dependent"] and "carried_from" not in keras_wrote
