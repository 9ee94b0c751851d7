"""Pytest plugin: Keras 3's own layer tests, each layer they test saved and loaded through
trainer's backends after Keras's own checks pass.

Loaded into a pytest run of the *installed* Keras layer test modules (nothing is copied)::

    TRAINER_LAYER_PEER_BACKENDS=savedmodel,h5,weights,savedmodel-revived \\
    TRAINER_LAYER_PEER_REPORT=/tmp/layers.json PYTHONPATH=tests/peer:. \\
        python -m pytest -p layer_routing_plugin --pyargs keras.src.layers

At ``pytest_configure`` it wraps ``keras.src.testing.TestCase.run_layer_test``: the
original runs first (Keras's serialization, build, symbolic, eager and training checks);
when it returns, every call with an input (``input_shape`` or ``input_data``) becomes one
*case* per backend, routed by ``layer_round_trip.round_trip``. A run is one of
``savedmodel``, ``h5``, ``weights`` (Functional wrapper, the layer's class available) or
``savedmodel-revived`` (subclassed wrapper; it and every Layer class of the Keras test
modules hidden at load). The test's own pass/fail stays Keras's: a routed case never fails
the child test, it is recorded in the JSON report (``TRAINER_LAYER_PEER_REPORT``) and
classified by ``tests/save_backends/test_keras_layer_peer_suite.py``.

Collection keeps only the tests that call ``run_layer_test`` (directly or through a helper
of their module): the others build no case, and some are minutes long (quantization).
``TRAINER_LAYER_PEER_ALL_TESTS=1`` keeps every test.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from routing_plugin import _key  # one test key for both peer suites

RUNS = {
    "savedmodel": ("savedmodel", "functional"),
    "h5": ("h5", "functional"),
    "weights": ("weights", "functional"),
    "savedmodel-revived": ("savedmodel", "revived"),
}
ENV_RUNS = "TRAINER_LAYER_PEER_BACKENDS"
ENV_REPORT = "TRAINER_LAYER_PEER_REPORT"
ENV_ALL = "TRAINER_LAYER_PEER_ALL_TESTS"

_state: dict[str, Any] = {
    "runs": [],
    "cases": {},
    "tests": {},
    "current": None,
    "calls": 0,
    "keras_seconds": 0.0,
    "run_seconds": {},
    "deselected": 0,
    "collect_errors": {},
}
_started = time.monotonic()


def _case_from(signature: inspect.Signature, args, kwargs) -> dict:
    """The arguments of one ``run_layer_test`` call, with the input Keras would create."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    data = a["input_data"]
    if data is None and a["input_shape"] is not None:
        import keras
        from keras.src import tree
        from keras.src.testing.test_case import create_eager_tensors

        dtype = a["input_dtype"]
        if dtype is None:
            dtype = tree.map_shape_structure(lambda _: "float32", a["input_shape"])
        keras.utils.set_random_seed(1337)
        data = create_eager_tensors(a["input_shape"], dtype, a["input_sparse"], a["input_ragged"])
    return {
        "layer_cls": a["layer_cls"],
        "init_kwargs": dict(a["init_kwargs"] or {}),
        "call_kwargs": dict(a["call_kwargs"] or {}),
        "input_data": data,
        "custom_objects": a["custom_objects"],
    }


def _install() -> None:
    from keras.src.testing import test_case

    original = test_case.TestCase.run_layer_test
    signature = inspect.signature(original)

    @functools.wraps(original)
    def run_layer_test(self, *args, **kwargs):
        started = time.monotonic()
        try:
            result = original(self, *args, **kwargs)
        finally:
            _state["keras_seconds"] += time.monotonic() - started
        test = _state["current"]
        _state["calls"] += 1
        entry = _state["tests"].setdefault(test, {"cases": 0})
        entry["cases"] += 1
        key = f"{test}#{entry['cases']}"
        case = _case_from(signature, (self, *args), kwargs)
        record: dict[str, Any] = {
            "layer": f"{case['layer_cls'].__module__}.{case['layer_cls'].__qualname__}",
            "runs": {},
        }
        workdir = Path(tempfile.mkdtemp(prefix="layerpeer-"))
        try:
            from layer_round_trip import route_case

            runs = {run: RUNS[run] for run in _state["runs"]}
            record["runs"] = route_case(case, runs, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        record["keras_reference"] = record["runs"].pop("_keras", None)
        for run, outcome in record["runs"].items():
            _state["run_seconds"][run] = _state["run_seconds"].get(run, 0.0) + outcome["seconds"]
        _state["cases"][key] = record
        _write()
        return result

    test_case.TestCase.run_layer_test = run_layer_test


# ---------------------------------------------------------------------- pytest hooks
def pytest_configure(config: pytest.Config) -> None:
    runs = [r for r in os.environ.get(ENV_RUNS, "").split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if not runs or unknown:
        raise pytest.UsageError(
            f"{ENV_RUNS} must list some of {', '.join(RUNS)}; received {runs!r}"
        )
    _state["runs"] = runs
    _provide_test_imports()
    _install()


def _provide_test_imports() -> None:
    """Two imports of Keras's test modules that its wheel does not satisfy, provided only
    when missing: ``conftest.skip_if_backend`` (a helper of Keras's repository conftest,
    imported by ``flatten_test``) and ``grain`` (imported at the top of six preprocessing
    test modules, used only by their ``*grain*`` tests, which call no ``run_layer_test`` and
    are deselected; any use of the stand-in raises)."""
    import importlib.util
    import types

    if importlib.util.find_spec("conftest") is None:
        conftest = types.ModuleType("conftest")

        def skip_if_backend(backend_name, reason):
            import keras

            return pytest.mark.skipif(keras.backend.backend() == backend_name, reason=reason)

        conftest.skip_if_backend = skip_if_backend
        sys.modules["conftest"] = conftest
    if importlib.util.find_spec("grain") is None:
        grain = types.ModuleType("grain")

        def missing(name):
            raise AttributeError(
                f"grain is not installed (layer peer suite stand-in): grain.{name}"
            )

        grain.__getattr__ = missing
        sys.modules["grain"] = grain


def pytest_collectreport(report) -> None:
    if report.failed:
        _state["collect_errors"][report.nodeid] = str(report.longrepr)[-600:]


def _calls_run_layer_test(item: pytest.Item, helpers: dict) -> bool:
    module = getattr(item, "module", None)
    if module is None:
        return True
    names = helpers.get(module.__name__)
    if names is None:
        names = set()
        for obj in vars(module).values():
            members = vars(obj).items() if isinstance(obj, type) else []
            for name, fn in members:
                if callable(fn) and not name.startswith("test"):
                    try:
                        if "run_layer_test" in inspect.getsource(fn):
                            names.add(name)
                    except (OSError, TypeError):
                        pass
        helpers[module.__name__] = names
    try:
        source = inspect.getsource(item.obj)
    except (OSError, TypeError):
        return True
    return "run_layer_test" in source or any(f".{n}(" in source for n in names)


def pytest_collection_modifyitems(session, config, items) -> None:
    if os.environ.get(ENV_ALL) == "1":
        return
    helpers: dict = {}
    keep = [item for item in items if _calls_run_layer_test(item, helpers)]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    _state["deselected"] = len(dropped)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    key = _key(item)
    _state["current"] = key
    _state["tests"].setdefault(key, {"cases": 0})
    yield
    _state["current"] = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    key = _state["current"]
    if key is None:
        return
    entry = _state["tests"].setdefault(key, {"cases": 0})
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["outcome"] = "failed"
        entry["message"] = (crash.message if crash else str(report.longrepr))[:1000]
    elif report.skipped and entry.get("outcome") != "failed":
        entry["outcome"] = "skipped"
    elif report.when == "call" and entry.get("outcome") is None:
        entry["outcome"] = "passed"


def _write() -> None:
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    import keras

    data = {
        "runs": _state["runs"],
        "keras_version": keras.__version__,
        "seconds": round(time.monotonic() - _started, 1),
        "keras_seconds": round(_state["keras_seconds"], 1),
        "run_seconds": {k: round(v, 1) for k, v in _state["run_seconds"].items()},
        "deselected": _state["deselected"],
        "collect_errors": _state["collect_errors"],
        "tests": _state["tests"],
        "cases": _state["cases"],
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)


def pytest_sessionfinish(session, exitstatus) -> None:
    _write()
