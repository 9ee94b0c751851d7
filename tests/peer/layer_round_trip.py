"""One case of Keras's layer tests through one trainer backend: wrap, save, load, compare.

Used by ``layer_routing_plugin`` after Keras's own ``run_layer_test`` checks passed. The
layer under test is built again from the test's class and arguments, called on the test's
input inside a small model, saved and loaded through a trainer backend, and the two models
are compared on what a user relies on:

* weights and variables: count, order, paths, shapes, dtypes and values (right after load);
* the class of the revived layer (the same class, unless the mode hides it);
* outputs on the test's input (inference; random layers seeded the same way on both);
* one training step (SGD, MSE against zeros): loss and every variable after it, where the
  model has trainable weights and floating outputs.

Outcomes: ``identical``; ``silent`` (the load succeeded but something differs: the worst
kind); ``loud`` (an exception from trainer's save or load, or from the loaded model where
the original worked); ``not_applicable`` with a ``rule`` naming why (each rule has its
reason in the expectations file; ``keras_round_trip_too``: every difference of a
functional run is one Keras's own ``.keras`` save and load of the same model shows too).

Modes: ``functional`` wraps the layer in a Functional model on the test's input shapes and
dtypes; ``revived`` (savedmodel only) wraps it in a subclassed model whose class, and every
Layer class the Keras test modules define, is hidden at load, so the load revives them from
their traced functions, as for a user who loads without the code.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
from hiding import WRAPPER_MODULE, is_test_class, test_classes_hidden

ATOL = 1e-6
RTOL = 1e-6
SEED = 1337
# A run of its own in every case's functional group: Keras's .keras save and load, the
# reference that tells which differences trainer adds (a difference Keras's own round
# trip shows too is marked "(keras too)" in the detail).
KERAS = "keras"
# The rule of a functional run's case whose every difference the reference shows too.
KERAS_TOO = "keras_round_trip_too"


class NotApplicable(Exception):
    """The case cannot be routed; ``rule`` names the reason listed in the expectations."""

    def __init__(self, rule: str, detail: str = ""):
        super().__init__(f"{rule}: {detail}")
        self.rule = rule
        self.detail = detail


class Loud(Exception):
    """Trainer raised, or the loaded model failed where the original worked."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


# ----------------------------------------------------------------------------- inputs
def _is_tensor(value: Any) -> bool:
    import tensorflow as tf

    return isinstance(value, (np.ndarray, tf.Tensor, tf.SparseTensor, tf.RaggedTensor)) or (
        hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)
    )


def _input_for(value: Any, name: str):
    """A ``keras.Input`` with the full (batch included) shape and dtype of ``value``."""
    import keras
    import tensorflow as tf

    sparse = isinstance(value, tf.SparseTensor)
    ragged = isinstance(value, tf.RaggedTensor)
    shape = tuple(value.shape.as_list() if hasattr(value.shape, "as_list") else value.shape)
    dtype = keras.backend.standardize_dtype(value.dtype)
    return keras.Input(batch_shape=shape, dtype=dtype, sparse=sparse, ragged=ragged, name=name)


def split_inputs(input_data: Any, call_kwargs: dict) -> tuple[list, dict, dict]:
    """The tensors the model takes (the test's input, then tensor-valued call arguments),
    and the call arguments that stay constants of the call (``training=True``, ...)."""
    import keras

    leaves = list(keras.tree.flatten(input_data))
    tensor_kwargs = {k: v for k, v in call_kwargs.items() if _is_tensor(v)}
    constants = {k: v for k, v in call_kwargs.items() if k not in tensor_kwargs}
    for key in sorted(tensor_kwargs):
        leaves.extend(keras.tree.flatten(tensor_kwargs[key]))
    return leaves, tensor_kwargs, constants


def _call_layer(layer, input_data, tensor_kwargs, constants, flat):
    """Call ``layer`` on ``flat`` (the model's flat inputs) packed as the test called it."""
    import keras

    count = len(keras.tree.flatten(input_data))
    structured = keras.tree.pack_sequence_as(input_data, flat[:count])
    kwargs = dict(constants)
    rest = flat[count:]
    for key in sorted(tensor_kwargs):
        n = len(keras.tree.flatten(tensor_kwargs[key]))
        kwargs[key] = keras.tree.pack_sequence_as(tensor_kwargs[key], rest[:n])
        rest = rest[n:]
    if isinstance(structured, dict):
        return layer(**structured, **kwargs)
    return layer(structured, **kwargs)


# ----------------------------------------------------------------------------- models
def build_functional(case: dict):
    """A Functional model: the test's inputs -> the layer under test."""
    import keras

    flat, tensor_kwargs, constants = split_inputs(case["input_data"], case["call_kwargs"])
    inputs = [_input_for(value, f"peer_in_{i}") for i, value in enumerate(flat)]
    layer = case["layer_cls"](**case["init_kwargs"])
    outputs = _call_layer(layer, case["input_data"], tensor_kwargs, constants, inputs)
    return keras.Model(inputs, outputs, name="peer_model"), layer, flat


def build_subclassed(case: dict):
    """A subclassed model holding the layer (its class hidden at load), built by one call."""
    import keras

    flat, tensor_kwargs, constants = split_inputs(case["input_data"], case["call_kwargs"])
    data, layer_cls, init = case["input_data"], case["layer_cls"], case["init_kwargs"]

    class PeerWrapper(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = layer_cls(**init)

        def call(self, inputs, training=None):
            extra = {} if "training" in constants or training is None else {"training": training}
            return _call_layer(self.inner, data, tensor_kwargs, {**constants, **extra}, inputs)

    PeerWrapper.__module__ = WRAPPER_MODULE  # hidden: see hiding.test_classes_hidden()
    model = PeerWrapper(name="peer_model")
    model(flat)
    return model, model.inner, flat


# ------------------------------------------------------------------------ comparisons
def _dense(value):
    import tensorflow as tf

    if isinstance(value, tf.SparseTensor):
        value = tf.sparse.to_dense(value)
    if isinstance(value, tf.RaggedTensor):
        value = value.to_tensor()
    return np.asarray(value)


def _close(a, b) -> bool:
    a, b = _dense(a), _dense(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        return bool(np.allclose(a, b, atol=ATOL, rtol=RTOL, equal_nan=True))
    return bool(np.array_equal(a, b))


def _describe(value) -> str:
    a = _dense(value)
    return f"{a.dtype}{list(a.shape)}"


def _path(variable) -> str:
    """A variable's path, a seed generator's automatic ``seed_generator_<n>`` numbering
    dropped: it counts the generators the process created (Keras's own load gets a new
    number as well), which no code can rely on."""
    return re.sub(r"(^|/)seed_generator_\d+/", r"\1seed_generator/", variable.path)


def snapshot(variables) -> list[tuple[str, str, tuple, str, np.ndarray]]:
    """(comparable path, path, shape, dtype, value) of each variable, in order."""
    return [
        (_path(v), v.path, tuple(v.shape), str(v.dtype), np.array(v.numpy())) for v in variables
    ]


def compare_variables(a: list, b: list, what: str) -> list[str]:
    """Differences between two snapshots: count, order, path, shape, dtype, value."""
    if len(a) != len(b):
        paths = f"{[x[1] for x in a]} vs {[y[1] for y in b]}"
        return [f"{what}: {len(a)} in the original, {len(b)} loaded ({paths})"]
    diffs = []
    for x, y in zip(a, b, strict=True):
        if x[0] != y[0]:
            diffs.append(f"{what}: path {x[1]!r} became {y[1]!r}")
        if x[2:4] != y[2:4]:
            diffs.append(f"{what} {x[1]}: {x[3]}{list(x[2])} became {y[3]}{list(y[2])}")
        elif not _close(x[4], y[4]):
            diffs.append(f"{what} {x[1]}: values differ")
    return diffs


def compare_outputs(a, b, what: str) -> list[str]:
    import keras

    fa, fb = keras.tree.flatten(a), keras.tree.flatten(b)
    if len(fa) != len(fb):
        return [f"{what}: {len(fa)} output tensors, loaded gives {len(fb)}"]
    diffs = []
    for i, (x, y) in enumerate(zip(fa, fb, strict=True)):
        if not _close(x, y):
            detail = f"{_describe(x)} vs {_describe(y)}"
            if _dense(x).shape == _dense(y).shape and _dense(x).dtype.kind in "fc":
                gap = np.nanmax(np.abs(_dense(x).astype("float64") - _dense(y).astype("float64")))
                detail += f", max |diff| {gap:.3g}"
            diffs.append(f"{what}[{i}] differs: {detail}")
    return diffs


def _find_layer(model, layer):
    for candidate in model._flatten_layers(include_self=False, recursive=True):
        if candidate.name == layer.name:
            return candidate
    return None


def _seeded(fn):
    import keras

    keras.utils.set_random_seed(SEED)
    return fn()


def _trainable(model, outputs) -> str | None:
    """Why no training step is compared (None: one is)."""
    import keras

    if not model.trainable_weights:
        return "no trainable weights"
    for x in keras.tree.flatten(outputs):
        if _dense(x).dtype.kind != "f":
            return f"output is {_dense(x).dtype} (not differentiable)"
    return None


def _as_function(model):
    import tensorflow as tf

    return tf.function(lambda inputs: model(inputs, training=False))


def _step(model, flat, targets):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return _seeded(lambda: model.train_on_batch(flat, targets))


# ------------------------------------------------------------------------- one case
def route_case(case: dict, runs: dict[str, tuple[str, str]], workdir: Path) -> dict[str, dict]:
    """Route one case through every run (``run -> (backend, mode)``); a record per run.

    One original per mode serves all its backends: every save is written before anything
    calls the original, and each loaded model repeats exactly what the original does
    (one inference call, then one training step), so random layers, whose generator
    states are part of the checkpoint, advance alike."""
    records: dict[str, dict] = {}
    for mode in ("functional", "revived"):
        group = {run: backend for run, (backend, m) in runs.items() if m == mode}
        if group and mode == "functional":
            group[KERAS] = KERAS
        if group:
            records.update(_route_group(case, mode, group, workdir))
    reference = records.pop(KERAS, None)
    if reference is not None:
        known = set(reference.get("diffs", []))
        for run, record in records.items():
            if record.get("diffs"):
                marked = [f"{d} (keras too)" if d in known else d for d in record["diffs"]]
                record["detail"] = "; ".join(marked)[:1500]
                record["keras_too"] = all(d in known for d in record["diffs"])
                if record["keras_too"] and runs[run][1] == "functional":
                    # Keras's own .keras round trip of the same model differs from the
                    # original in exactly these ways: Keras's behaviour, not trainer's.
                    record["outcome"] = "not_applicable"
                    record["rule"] = KERAS_TOO
        records["_keras"] = {k: v for k, v in reference.items() if k != "diffs"}
    for record in records.values():
        record.pop("diffs", None)
    return records


def _na(error: NotApplicable) -> dict:
    return {"outcome": "not_applicable", "rule": error.rule, "detail": error.detail[:600]}


def _loud(loud: Loud) -> dict:
    error = loud.error
    return {
        "outcome": "loud",
        "stage": loud.stage,
        "error": type(error).__name__,
        "trainer_error": _is_trainer_error(error),
        "detail": f"{loud.stage}: {type(error).__name__}: {_clip(str(error))}",
    }


def _clip(text: str) -> str:
    """The head (what failed) and the tail (the innermost error) of a long message."""
    return text if len(text) <= 900 else f"{text[:400]} [...] {text[-500:]}"


def _is_trainer_error(error: BaseException) -> bool:
    from trainer.errors import TrainerError

    return isinstance(error, TrainerError)


def _build(case: dict, mode: str):
    import keras

    if case["input_data"] is None:
        raise NotApplicable("no_input", "the test gives no input shape or data")
    try:
        keras.utils.set_random_seed(SEED)
        build = build_subclassed if mode == "revived" else build_functional
        return build(case)
    except Exception as error:
        raise NotApplicable("keras_cannot_wrap", f"{type(error).__name__}: {error}") from error


def _save_load(model, case: dict, backend: str, mode: str, workdir: Path):
    from trainer.save_backends import get_backend

    custom = dict(case.get("custom_objects") or {})
    if mode != "revived" and is_test_class(case["layer_cls"]):
        custom.setdefault(case["layer_cls"].__name__, case["layer_cls"])
    if backend == KERAS:  # the reference: Keras's own .keras round trip
        import keras

        path = workdir / "case.keras"
        model.save(path)
        return keras.saving.load_model(path, custom_objects=custom, compile=False)
    try:
        path = get_backend(backend).save(model, workdir / f"case-{backend}")
    except Exception as error:
        raise Loud("save", error) from error
    hide = test_classes_hidden() if mode == "revived" else contextlib.nullcontext()
    try:
        with hide:
            return get_backend(backend).load(path, custom_objects=custom, compile=False).model
    except Exception as error:
        raise Loud("load", error) from error


def _static_diffs(model, loaded, layer, mode: str) -> tuple[list[str], str | None]:
    """Weights and variables right after load, and the revived layer's class."""
    diffs = compare_variables(snapshot(model.weights), snapshot(loaded.weights), "weights")
    diffs += compare_variables(
        snapshot(model.non_trainable_variables),
        snapshot(loaded.non_trainable_variables),
        "non_trainable_variables",
    )
    revived = _find_layer(loaded, layer)
    if revived is None:
        return [*diffs, f"no layer named {layer.name!r} in the loaded model"], None
    name = type(revived).__name__
    # A stand-in that is an instance of the class (a safe-mode Lambda running its trace)
    # passes the isinstance checks users write; any other class is a difference.
    if mode != "revived" and not isinstance(revived, type(layer)):
        diffs.append(f"class {type(layer).__name__} came back as {type(revived).__module__}.{name}")
    return diffs, name


def _route_group(case: dict, mode: str, group: dict[str, str], workdir: Path) -> dict:
    import keras

    started = time.monotonic()
    records: dict[str, dict] = {}
    seconds = dict.fromkeys(group, 0.0)
    loaded, diffs, classes = {}, {}, {}

    def timed(run, fn):
        t = time.monotonic()
        try:
            return fn()
        finally:
            seconds[run] += time.monotonic() - t

    try:
        model, layer, flat = _build(case, mode)
        for run, backend in group.items():
            if mode == "revived" and backend != "savedmodel":
                records[run] = _na(NotApplicable("revived_needs_savedmodel", backend))
                continue
            try:
                loaded[run] = timed(
                    run, lambda b=backend: _save_load(model, case, b, mode, workdir)
                )
            except Loud as loud:
                records[run] = _loud(loud)
        for run, m in loaded.items():
            diffs[run], classes[run] = _static_diffs(model, m, layer, mode)
        try:
            reference = _seeded(lambda: model(flat, training=False))
        except Exception as error:
            raise NotApplicable("keras_cannot_call", f"{type(error).__name__}: {error}") from error
        graph_reference = None
        for run, m in list(loaded.items()):
            try:
                result = timed(run, lambda m=m: _seeded(lambda: m(flat, training=False)))
            except Exception as error:
                records[run] = _loud(Loud("call", error))
                del loaded[run]
                continue
            found = compare_outputs(reference, result, "outputs")
            if found and mode == "revived":
                # Traced functions compute as the original does inside a tf.function,
                # whose float results may differ from eager ones by rounding (fused ops).
                if graph_reference is None:
                    graph_reference = _seeded(lambda: _as_function(model)(flat))
                if not compare_outputs(graph_reference, result, "outputs"):
                    found = []
            diffs[run] += found
        why_not = _trainable(model, reference) if loaded else "nothing loaded"
        if why_not is None:
            targets = keras.tree.map_structure(lambda x: np.zeros_like(_dense(x)), reference)
            try:
                loss = _step(model, flat, targets)
                after = snapshot(model.variables)
            except Exception as error:  # Keras cannot train the wrapped original either
                why_not = f"the original does not train: {type(error).__name__}: {str(error)[:200]}"
        for run, m in loaded.items():
            if why_not is None:
                try:
                    loss_b = timed(run, lambda m=m: _step(m, flat, targets))
                except Exception as error:
                    records[run] = _loud(Loud("train", error))
                    continue
                if not np.allclose(loss, loss_b, atol=1e-5, rtol=1e-5):
                    diffs[run].append(f"training step: loss {loss} vs {loss_b} loaded")
                diffs[run] += compare_variables(
                    after, snapshot(m.variables), "after one step: variables"
                )
            records[run] = {
                "outcome": "silent" if diffs[run] else "identical",
                "detail": "; ".join(diffs[run])[:1500],
                "diffs": diffs[run],
                "revived_class": classes[run],
                "training": why_not or "compared",
            }
    except NotApplicable as na:
        for run in group:
            records.setdefault(run, _na(na))
    shared = (time.monotonic() - started - sum(seconds.values())) / len(group)
    for run in group:
        records[run]["seconds"] = round(seconds[run] + shared, 3)
    return records
