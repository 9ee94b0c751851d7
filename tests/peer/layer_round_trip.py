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
reason in the expectations file).

Modes: ``functional`` wraps the layer in a Functional model on the test's input shapes and
dtypes; ``revived`` (savedmodel only) wraps it in a subclassed model whose class, and every
Layer class the Keras test modules define, is hidden at load, so the load revives them from
their traced functions, as for a user who loads without the code.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ATOL = 1e-6
RTOL = 1e-6
SEED = 1337


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

    PeerWrapper.__module__ = "peer_hidden_test"  # hidden: see hidden_classes()
    model = PeerWrapper(name="peer_model")
    model(flat)
    return model, model.inner, flat


@contextlib.contextmanager
def hidden_classes():
    """Hide every Layer class a Keras test module defines (module attributes and registry
    entries), so that the load cannot find them and revives them from traces."""
    import keras
    from keras.src.saving import object_registration

    hidden: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("keras.src.") and name.endswith("_test")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and issubclass(value, keras.layers.Layer):
                if value.__module__ == name:
                    hidden.append((module, attr, value))
                    delattr(module, attr)
    registry = object_registration.GLOBAL_CUSTOM_OBJECTS
    names = object_registration.GLOBAL_CUSTOM_NAMES
    removed = {k: v for k, v in registry.items() if getattr(v, "__module__", "").endswith("_test")}
    for key, cls in removed.items():
        registry.pop(key)
    saved_names = {cls: names.pop(cls) for cls in removed.values() if cls in names}
    try:
        yield
    finally:
        for module, attr, value in hidden:
            setattr(module, attr, value)
        registry.update(removed)
        names.update(saved_names)


def is_test_class(cls: type) -> bool:
    return cls.__module__.endswith("_test") or cls.__module__ == "peer_hidden_test"


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


def compare_variables(original, loaded, what: str, collection: str) -> list[str]:
    """Differences between two lists of variables: count, order, path, shape, dtype, value."""
    a, b = getattr(original, collection), getattr(loaded, collection)
    if len(a) != len(b):
        return [
            f"{what}.{collection}: {len(a)} in the original, {len(b)} loaded "
            f"({[v.path for v in a]} vs {[v.path for v in b]})"
        ]
    diffs = []
    for x, y in zip(a, b):
        if _path(x) != _path(y):
            diffs.append(f"{what}.{collection}: path {x.path!r} became {y.path!r}")
        if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
            diffs.append(f"{x.path}: {x.dtype}{list(x.shape)} became {y.dtype}{list(y.shape)}")
        elif not _close(x.numpy(), y.numpy()):
            diffs.append(f"{what}.{collection} {x.path}: values differ")
    return diffs


def compare_outputs(a, b, what: str) -> list[str]:
    import keras

    fa, fb = keras.tree.flatten(a), keras.tree.flatten(b)
    if len(fa) != len(fb):
        return [f"{what}: {len(fa)} output tensors, loaded gives {len(fb)}"]
    diffs = []
    for i, (x, y) in enumerate(zip(fa, fb)):
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


def compare_training(original, loaded, flat, outputs) -> tuple[list[str], str | None]:
    """One SGD step on both models; differences, and why the step was not compared."""
    import keras

    why_not = _trainable(original, outputs)
    if why_not:
        return [], why_not
    targets = keras.tree.map_structure(lambda x: np.zeros_like(_dense(x)), outputs)

    def step(model):
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
        return _seeded(lambda: model.train_on_batch(flat, targets))

    try:
        loss_a = step(original)
    except Exception as error:  # Keras cannot train the wrapped original either
        return [], f"the original does not train: {type(error).__name__}: {str(error)[:200]}"
    try:
        loss_b = step(loaded)
    except Exception as error:
        raise Loud("train", error) from error
    diffs = []
    if not np.allclose(loss_a, loss_b, atol=1e-5, rtol=1e-5):
        diffs.append(f"training step: loss {loss_a} vs {loss_b} loaded")
    diffs += [
        f"after one step: {d}" for d in compare_variables(original, loaded, "model", "variables")
    ]
    return diffs, None


# ------------------------------------------------------------------------- one case
def round_trip(case: dict, backend: str, mode: str, workdir: Path) -> dict:
    """Route one case; the outcome record (never raises for the case's own failures)."""
    started = time.monotonic()
    try:
        record = _round_trip(case, backend, mode, workdir)
    except NotApplicable as na:
        record = {"outcome": "not_applicable", "rule": na.rule, "detail": na.detail[:600]}
    except Loud as loud:
        error = loud.error
        record = {
            "outcome": "loud",
            "stage": loud.stage,
            "error": type(error).__name__,
            "trainer_error": _is_trainer_error(error),
            "detail": f"{loud.stage}: {type(error).__name__}: {str(error)[:800]}",
        }
    record["seconds"] = round(time.monotonic() - started, 3)
    return record


def _is_trainer_error(error: BaseException) -> bool:
    from trainer.errors import TrainerError

    return isinstance(error, TrainerError)


def _round_trip(case: dict, backend: str, mode: str, workdir: Path) -> dict:
    import keras

    from trainer.save_backends import get_backend

    if case["input_data"] is None:
        raise NotApplicable("no_input", "the test gives no input shape or data")
    if mode == "revived" and backend != "savedmodel":
        raise NotApplicable("revived_needs_savedmodel", backend)
    try:
        keras.utils.set_random_seed(SEED)
        build = build_subclassed if mode == "revived" else build_functional
        model, layer, flat = build(case)
    except Exception as error:
        raise NotApplicable("keras_cannot_wrap", f"{type(error).__name__}: {error}") from error

    custom = dict(case.get("custom_objects") or {})
    if mode != "revived" and is_test_class(case["layer_cls"]):
        custom.setdefault(case["layer_cls"].__name__, case["layer_cls"])
    try:
        path = get_backend(backend).save(model, workdir / "case")
    except Exception as error:
        raise Loud("save", error) from error
    hide = hidden_classes() if mode == "revived" else contextlib.nullcontext()
    try:
        with hide:
            loaded = get_backend(backend).load(path, custom_objects=custom, compile=False).model
    except Exception as error:
        raise Loud("load", error) from error

    diffs = compare_variables(model, loaded, "model", "weights")
    diffs += compare_variables(model, loaded, "model", "non_trainable_variables")
    revived = _find_layer(loaded, layer)
    revived_class = type(revived).__name__ if revived is not None else None
    if revived is None:
        diffs.append(f"no layer named {layer.name!r} in the loaded model")
    elif mode != "revived" and type(revived) is not type(layer):
        diffs.append(
            f"class {type(layer).__name__} came back as {type(revived).__module__}.{revived_class}"
        )

    try:
        reference = _seeded(lambda: model(flat, training=False))
    except Exception as error:
        raise NotApplicable("keras_cannot_call", f"{type(error).__name__}: {error}") from error
    try:
        result = _seeded(lambda: loaded(flat, training=False))
    except Exception as error:
        raise Loud("call", error) from error
    diffs += compare_outputs(reference, result, "outputs")
    train_diffs, untrained = compare_training(model, loaded, flat, reference)
    diffs += train_diffs
    record = {
        "outcome": "silent" if diffs else "identical",
        "detail": "; ".join(diffs)[:1500],
        "revived_class": revived_class,
        "training": untrained or "compared",
    }
    return record
