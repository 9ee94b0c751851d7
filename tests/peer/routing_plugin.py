"""Pytest plugin: run Keras 3's own saving tests with Keras's save/load routed through trainer.

Loaded into a pytest run of the *installed* Keras test modules (nothing is copied)::

    TRAINER_PEER_BACKEND=h5 TRAINER_PEER_REPORT=/tmp/h5.json PYTHONPATH=tests/peer:. \\
        python -m pytest -p routing_plugin --pyargs keras.src.saving.saving_lib_test

or, several runs in one process (``TRAINER_PEER_RUNS``, see the hooks below), as
``tests/save_backends/test_keras_peer_suites.py`` does.

At ``pytest_configure`` it replaces Keras's public save/load entry points (and every
module-level alias of them inside ``keras``, such as ``saving_lib.save_model`` that the
tests import directly) with routers:

* a *save* Keras would write as a whole-model file (a path ending in ``.keras``, or
  ``.h5``/``.hdf5`` for the public API, zipped, no extra options) becomes
  ``get_backend(B).save(model, path)``; the backend may add its suffix
  (``backend.checkpoint_path(path)``), and loads map the same path the same way;
* a *load* of a path that holds a checkpoint of backend B (or that a routed save wrote)
  becomes ``get_backend(B).load(path, custom_objects=, compile=, safe_mode=).model``;
* with B = savedmodel (the only backend whose checkpoint is a SavedModel), a SavedModel
  export (``export_saved_model``, ``Model.export(format="tf_saved_model")``) without
  ``input_signature`` or backend-specific options becomes ``get_backend(B).save``.

Everything trainer has no equivalent for is passed to the original Keras function and
counted as a fall-through, never as reaching trainer: file objects (``BytesIO``),
``zipped=False`` directories, deprecated or unknown arguments (Keras's own argument
checks), other extensions, and loads of files trainer did not write (fixtures, zips the
test crafts, legacy H5 written by ``save_model_to_hdf5``). While an original Keras
function or a trainer backend runs, the routers step aside, so nothing is routed twice.

Per run and test, the report (JSON at ``TRAINER_PEER_REPORT``) records the outcome, the failure
message, how many saves/loads reached trainer, the fall-throughs and trainer's errors. A
test with no save or load through trainer is *not applicable*, whatever its outcome.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hiding import test_classes_hidden

BACKENDS = ("savedmodel", "h5", "weights")
ENV_BACKEND = "TRAINER_PEER_BACKEND"
# "1": a SavedModel a routed export wrote is opened with ``tf.saved_model.load`` only as
# trainer would revive it, with the test modules' custom classes unregistered: the
# export suite's checks of ``serve`` outputs then test revival from traced functions.
ENV_REVIVE = "TRAINER_PEER_REVIVE"
ENV_REPORT = "TRAINER_PEER_REPORT"
MAX_TEXT = 2000


class _Router:
    """The routers and their per-test counters, for the run in progress (``switch``)."""

    def __init__(self, backend: str, revive: bool = False):
        self.bypass = 0  # > 0 while original Keras code or trainer runs
        self.patched: list[str] = []
        self.switch(backend, revive)

    def switch(self, backend: str, revive: bool) -> None:
        """Route to ``backend`` from now on (a new run: nothing it wrote before counts)."""
        from trainer.save_backends import backend_class

        self.backend = backend
        self.cls = backend_class(backend)
        self.revive = revive
        self.written: set[str] = set()  # real paths routed saves produced
        self.reset()

    def reset(self) -> None:
        self.counts: dict[str, Any] = {
            "saves": 0,
            "loads": 0,
            "exports": 0,
            "fallthrough_saves": 0,
            "fallthrough_loads": 0,
            "fallthrough_exports": 0,
            "trainer_errors": [],
            "calls": [],
            # A fall-through decided by the backend (a load of a file it cannot read, an
            # export it writes no SavedModel for): another run's backend might take it.
            "backend_dependent": False,
        }

    @contextlib.contextmanager
    def stepping_aside(self):
        self.bypass += 1
        try:
            yield
        finally:
            self.bypass -= 1

    def _note(self, text: str) -> None:
        if len(self.counts["calls"]) < 20:
            self.counts["calls"].append(text)

    def _trainer(self, kind: str, api: str, path: Any, call):
        self.counts[kind] += 1
        try:
            with self.stepping_aside():
                return call()
        except BaseException as error:
            self.counts["trainer_errors"].append(
                f"{kind[:-1]} via {api}: {type(error).__name__}: {str(error)[:300]}"
            )
            raise

    def _fallthrough(self, kind: str, api: str, reason: str, original, *args, **kwargs):
        self.counts[f"fallthrough_{kind}"] += 1
        self._note(f"keras {kind[:-1]} via {api} ({reason})")
        with self.stepping_aside():
            return original(*args, **kwargs)

    # ------------------------------------------------------------------ save
    def save(self, api: str, original, model, filepath, *, why_not: str | None, args, kwargs):
        """Route one save, or hand it to ``original(*args, **kwargs)`` with the reason."""
        if self.bypass:
            return original(*args, **kwargs)
        if why_not is None and not isinstance(filepath, (str, os.PathLike)):
            why_not = f"target is a {type(filepath).__name__}, not a path"
        if why_not is None and str(filepath).startswith("hf://"):
            why_not = "Hugging Face Hub target"
        if why_not is not None:
            return self._fallthrough("saves", api, why_not, original, *args, **kwargs)
        from trainer.save_backends import get_backend

        real = self._trainer(
            "saves", api, filepath, lambda: get_backend(self.backend).save(model, filepath)
        )
        self.written.add(os.path.abspath(real))
        self._note(f"trainer save via {api}: {Path(filepath).name} -> {Path(real).name}")
        return None  # as Keras

    # ---------------------------------------------------------------- export
    def export(self, api: str, original, model, filepath, *, why_not: str | None, args, kwargs):
        """Route one SavedModel export to the savedmodel backend (the only one whose
        checkpoint is a SavedModel), or hand it to ``original``."""
        if self.bypass:
            return original(*args, **kwargs)
        if why_not is None and self.backend != "savedmodel":
            why_not = f"the {self.backend} backend writes no SavedModel"
            self.counts["backend_dependent"] = True
        if why_not is None and not isinstance(filepath, (str, os.PathLike)):
            why_not = f"target is a {type(filepath).__name__}, not a path"
        if why_not is not None:
            return self._fallthrough("exports", api, why_not, original, *args, **kwargs)
        from trainer.save_backends import get_backend

        real = self._trainer(
            "exports", api, filepath, lambda: get_backend(self.backend).save(model, filepath)
        )
        self.written.add(os.path.abspath(real))
        self._note(f"trainer save via {api}: {Path(filepath).name} -> {Path(real).name}")
        return None

    # ------------------------------------------------------------------ load
    def load(
        self,
        api: str,
        original,
        filepath,
        custom_objects=None,
        compile=True,
        safe_mode=True,
        **extra,
    ):
        args = (filepath,)
        kwargs = dict(custom_objects=custom_objects, compile=compile, safe_mode=safe_mode)
        kwargs.update(extra)
        if self.bypass:
            return original(*args, **kwargs)
        if extra:
            why_not = f"arguments {sorted(extra)}"
        elif isinstance(filepath, io.IOBase) or not isinstance(filepath, (str, os.PathLike)):
            why_not = f"source is a {type(filepath).__name__}, not a path"
        else:
            from trainer.save_backends import get_backend

            mapped = get_backend(self.backend).checkpoint_path(filepath)
            if self.cls.can_load(mapped) or os.path.abspath(mapped) in self.written:
                model = self._trainer(
                    "loads",
                    api,
                    mapped,
                    lambda: (
                        get_backend(self.backend)
                        .load(
                            mapped,
                            custom_objects=custom_objects,
                            compile=compile,
                            safe_mode=safe_mode,
                        )
                        .model
                    ),
                )
                self._note(f"trainer load via {api}: {mapped.name}")
                return model
            why_not = "not a trainer checkpoint"
            self.counts["backend_dependent"] = True
        return self._fallthrough("loads", api, why_not, original, *args, **kwargs)


class _Served:
    """What the revive run hands a test instead of ``tf.saved_model.load``'s object: the
    revived Keras model behind the ``serve`` endpoint the export suite calls."""

    def __init__(self, model):
        self.model = model

    def serve(self, *args, **kwargs):
        return self.model(*args, training=False, **kwargs)


def _install_revive(router: _Router) -> None:
    import tensorflow as tf

    original = tf.saved_model.load

    @functools.wraps(original)
    def revive_load(export_dir, *args, **kwargs):
        if not router.revive or router.bypass or os.path.abspath(export_dir) not in router.written:
            return original(export_dir, *args, **kwargs)
        from trainer.save_backends import get_backend

        def revive():
            with test_classes_hidden():
                return get_backend("savedmodel").load(export_dir, compile=False).model

        model = router._trainer("loads", "tf.saved_model.load", export_dir, revive)
        router._note(f"trainer revival via tf.saved_model.load: {Path(export_dir).name}")
        return _Served(model)

    tf.saved_model.load = revive_load
    router.patched.append("tf.saved_model.load")


_router: _Router | None = None
_results: dict[str, dict[str, dict[str, Any]]] = {}  # run -> test key -> entry
_seconds: dict[str, float] = {}  # run -> its tests' wall time
_started = time.monotonic()


def _save_api_why_not(filepath, zipped, kwargs) -> str | None:
    """Why ``keras.saving.save_model`` / ``Model.save`` arguments are not for trainer."""
    if kwargs:
        return f"arguments {sorted(kwargs)} (Keras's argument checks)"
    if zipped is False:
        return "zipped=False directory"
    if isinstance(filepath, (str, os.PathLike)) and not str(filepath).endswith(
        (".keras", ".h5", ".hdf5")
    ):
        return "not a .keras/.h5 path (Keras's extension check)"
    return None


def _install(router: _Router) -> None:
    import keras
    from keras.src.models import model as model_module
    from keras.src.saving import saving_api, saving_lib

    originals = {
        "save_api": saving_api.save_model,
        "load_api": saving_api.load_model,
        "save_lib": saving_lib.save_model,
        "load_lib": saving_lib.load_model,
    }
    model_save = model_module.Model.save

    @functools.wraps(originals["save_api"])
    def save_api(model, filepath, overwrite=True, zipped=None, **kwargs):
        why_not = _save_api_why_not(filepath, zipped, kwargs)
        if why_not is None and not overwrite and os.path.exists(filepath):
            why_not = "overwrite=False on an existing path"
        return router.save(
            "saving_api.save_model",
            originals["save_api"],
            model,
            filepath,
            why_not=why_not,
            args=(model, filepath),
            kwargs=dict(overwrite=overwrite, zipped=zipped, **kwargs),
        )

    @functools.wraps(originals["save_lib"])
    def save_lib(model, filepath, weights_format="h5", zipped=True):
        why_not = None
        if weights_format != "h5":
            why_not = f"weights_format={weights_format!r}"
        elif not zipped:
            why_not = "zipped=False directory"
        elif isinstance(filepath, (str, os.PathLike)) and not str(filepath).endswith(".keras"):
            why_not = "not a .keras path (Keras's extension check)"
        return router.save(
            "saving_lib.save_model",
            originals["save_lib"],
            model,
            filepath,
            why_not=why_not,
            args=(model, filepath),
            kwargs=dict(weights_format=weights_format, zipped=zipped),
        )

    @functools.wraps(model_save)
    def save_method(self, filepath, overwrite=True, zipped=None, **kwargs):
        why_not = _save_api_why_not(filepath, zipped, kwargs)
        if why_not is None and not overwrite and os.path.exists(filepath):
            why_not = "overwrite=False on an existing path"
        return router.save(
            "Model.save",
            model_save,
            self,
            filepath,
            why_not=why_not,
            args=(self, filepath),
            kwargs=dict(overwrite=overwrite, zipped=zipped, **kwargs),
        )

    @functools.wraps(originals["load_api"])
    def load_api(filepath, *args, **kwargs):
        return router.load(
            "saving_api.load_model", originals["load_api"], filepath, *args, **kwargs
        )

    @functools.wraps(originals["load_lib"])
    def load_lib(filepath, *args, **kwargs):
        return router.load(
            "saving_lib.load_model", originals["load_lib"], filepath, *args, **kwargs
        )

    from keras.src.export import saved_model as export_module

    originals["export"] = export_module.export_saved_model
    model_export = model_module.Model.export

    def _export_why_not(format, input_signature, kwargs) -> str | None:
        if format != "tf_saved_model":
            return f"format={format!r}"
        if input_signature is not None:
            return "input_signature given (trainer traces the model's own signature)"
        if kwargs:
            return f"arguments {sorted(kwargs)}"
        return None

    @functools.wraps(originals["export"])
    def export_api(model, filepath, verbose=None, input_signature=None, **kwargs):
        return router.export(
            "export_saved_model",
            originals["export"],
            model,
            filepath,
            why_not=_export_why_not("tf_saved_model", input_signature, kwargs),
            args=(model, filepath),
            kwargs=dict(verbose=verbose, input_signature=input_signature, **kwargs),
        )

    @functools.wraps(model_export)
    def export_method(
        self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs
    ):
        return router.export(
            "Model.export",
            model_export,
            self,
            filepath,
            why_not=_export_why_not(format, input_signature, kwargs),
            args=(self, filepath),
            kwargs=dict(format=format, verbose=verbose, input_signature=input_signature, **kwargs),
        )

    replacements = {
        id(originals["export"]): export_api,
        id(originals["save_api"]): save_api,
        id(originals["load_api"]): load_api,
        id(originals["save_lib"]): save_lib,
        id(originals["load_lib"]): load_lib,
    }
    # Every alias inside keras: keras.saving.*, keras.models.*, keras.src.saving.*, ...
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "keras" or name.startswith("keras.")):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in replacements:
                setattr(module, attr, replacements[id(value)])
                router.patched.append(f"{name}.{attr}")
    model_module.Model.save = save_method
    model_module.Model.export = export_method
    router.patched += ["keras.Model.save", "keras.Model.export"]
    assert keras.Model.save is save_method
    for entry in ("saving.save_model", "saving.load_model", "models.save_model"):
        module, attr = entry.split(".")
        assert getattr(getattr(keras, module), attr) in (save_api, load_api), entry
    assert keras.models.load_model is load_api


# ---------------------------------------------------------------------- pytest hooks
# Several runs in one child (``TRAINER_PEER_RUNS``, JSON): {name: {"backend": B,
# "revive": bool, "suites": [module, ...]}}; each run executes the collected tests of its
# suites with the routers switched to its backend, one run after the other. One process
# imports TensorFlow, Keras and the test modules once for all runs.
ENV_RUNS = "TRAINER_PEER_RUNS"
_runs: dict[str, dict[str, Any]] = {}
_run: str | None = None  # the run in progress


def _parse_runs() -> dict[str, dict[str, Any]]:
    """The runs to make: ``TRAINER_PEER_RUNS``, or one run of every collected test named
    after ``TRAINER_PEER_BACKEND`` (with ``TRAINER_PEER_REVIVE``)."""
    raw = os.environ.get(ENV_RUNS)
    if raw:
        runs = json.loads(raw)
    else:
        backend = os.environ.get(ENV_BACKEND, "")
        revive = os.environ.get(ENV_REVIVE) == "1"
        runs = {backend: {"backend": backend, "revive": revive, "suites": None}}
    for name, spec in runs.items():
        if spec["backend"] not in BACKENDS:
            raise pytest.UsageError(
                f"run {name!r}: {ENV_BACKEND} or a run's backend must be one of "
                f"{', '.join(BACKENDS)}; received {spec['backend']!r}"
            )
        if spec.get("revive") and spec["backend"] != "savedmodel":
            raise pytest.UsageError(f"run {name!r}: revive needs backend savedmodel")
    return runs


def pytest_configure(config: pytest.Config) -> None:
    global _router
    _runs.update(_parse_runs())
    first = next(iter(_runs.values()))
    _router = _Router(first["backend"], bool(first.get("revive")))
    _install(_router)
    if any(spec.get("revive") for spec in _runs.values()):
        _install_revive(_router)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    """Each run in turn over the items of its suites (pytest's own loop, once per run).

    A test that reached no backend in an earlier run, and whose every fall-through was
    decided by its arguments alone (not by what the backend can read or write), runs the
    same Keras code with the same routing in every run: it is not run again, its entry is
    carried over (``carried_from``) and classified as if it had run."""
    global _run
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} errors during collection")
    if session.config.option.collectonly:
        return True
    neutral: dict[str, tuple[str, dict[str, Any]]] = {}  # key -> (run, entry)
    for name, spec in _runs.items():
        suites = spec.get("suites")
        items = [
            item for item in session.items if suites is None or _key(item).split("::")[0] in suites
        ]
        _run = name
        _router.switch(spec["backend"], bool(spec.get("revive")))
        _results[name] = {}
        for key in [_key(item) for item in items if _key(item) in neutral]:
            first, entry = neutral[key]
            _results[name][key] = {**entry, "carried_from": first}
        items = [item for item in items if _key(item) not in neutral]
        started = time.monotonic()
        for i, item in enumerate(items):
            nextitem = items[i + 1] if i + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        _seconds[name] = round(time.monotonic() - started, 1)
        for key, entry in _results[name].items():
            if not (entry["reached_trainer"] or entry["backend_dependent"] or key in neutral):
                neutral[key] = (name, entry)
        _write()
    return True


def _key(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    parts = item.nodeid.split("::")[1:]
    return "::".join([module.__name__ if module else item.nodeid.split("::")[0], *parts])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    assert _router is not None
    _router.reset()
    item._peer_reports = []  # type: ignore[attr-defined]
    yield
    counts = _router.counts
    reports = item._peer_reports  # type: ignore[attr-defined]
    entry: dict[str, Any] = {"outcome": "passed", "message": "", "when": "", "duration": 0.0}
    for report in reports:
        entry["duration"] += report.duration
        if report.failed and entry["outcome"] != "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            text = str(report.longrepr)
            entry.update(
                outcome="failed",
                when=report.when,
                message=(crash.message if crash else text)[:MAX_TEXT],
                failing_lines=getattr(report, "peer_failing_lines", []),
                longrepr_tail=text[-MAX_TEXT:],
            )
        elif report.skipped and entry["outcome"] == "passed":
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            entry.update(outcome="skipped", when=report.when, message=str(reason)[:MAX_TEXT])
    entry["duration"] = round(entry["duration"], 3)
    entry.update({k: counts[k] for k in counts})
    entry["reached_trainer"] = counts["saves"] + counts["loads"] + counts["exports"] > 0
    _results[_run][_key(item)] = entry
    _write()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None:
        return
    # The source line of every frame in the test's own module: which assertion failed,
    # since messages such as "False is not true" are generic.
    module_file = getattr(getattr(item, "module", None), "__file__", None)
    lines = []
    for entry in call.excinfo.traceback:
        if module_file and str(entry.path) == module_file:
            with contextlib.suppress(Exception):
                lines.append(str(entry.statement).strip()[:300])
    report.peer_failing_lines = lines[-6:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Reports arrive inside pytest_runtest_protocol; keep them on the current item.
    item = _current.get(report.nodeid)
    if item is not None:
        item._peer_reports.append(report)


_current: dict[str, pytest.Item] = {}


def pytest_collection_modifyitems(session, config, items) -> None:
    for item in items:
        _current[item.nodeid] = item


def _write() -> None:
    path = os.environ.get(ENV_REPORT)
    if not path or _router is None:
        return
    import keras

    data = {
        "keras_version": keras.__version__,
        "patched": _router.patched,
        "seconds": round(time.monotonic() - _started, 1),
        "runs": {
            name: {
                "backend": _runs[name]["backend"],
                "revive": bool(_runs[name].get("revive")),
                "seconds": _seconds.get(name),
                "tests": tests,
            }
            for name, tests in _results.items()
        },
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)


def pytest_sessionfinish(session, exitstatus) -> None:
    _write()
