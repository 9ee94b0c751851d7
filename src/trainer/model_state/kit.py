"""The model-state kit for backend authors: everything about a Keras model that a checkpoint
stores the same way whatever its format.

- the architecture as a config (:func:`model_config`) and the model rebuilt from it without
  running stored code unless ``safe_mode=False`` (:func:`rebuild_model`);
- the compile arguments (:func:`compile_config`) and compiling from them, always under
  ``safe_mode`` (:func:`compile_model`), with the optimizer built (:func:`build_optimizer`);
- the variables as ``(path, array)`` lists: model weights, RNG seed states, optimizer
  variables, and copying arrays back by position with one error type
  (:func:`assign_by_position` raises ``CorruptCheckpointError`` on any count or shape
  mismatch);
- bounded JSON for the documents stored next to the arrays (:func:`to_json`,
  :func:`from_json`).

Variables are matched by position, not by path: Keras names variables (and optimizer slots,
after the layer paths at creation time) differently in the process that loads them.
Position is stable because both sides build the same model and optimizer over the same
variables in the same order: ``model.trainable_variables``, or, when a layer was frozen or
unfrozen after the optimizer was built, the weights it was built for, whose positions the
compile config records (``trainable.optimizer_built_for``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import json
import weakref
from pathlib import Path
from typing import Any

import keras
import numpy as np

from trainer._compat import keras as keras_compat
from trainer._compat import keras_training as training_compat
from trainer.errors import (
    CorruptCheckpointError,
    ModelNotReadyError,
    SaveError,
)
from trainer.model_state import compile_objects, dtype_policy, rebuild
from trainer.model_state.deserializing import deserialize
from trainer.model_state.deserializing import (  # part of this kit (the redundant alias
    names_a_missing_class as names_a_missing_class,  # marks the re-export for linters)
)
from trainer.model_state.trainable import (  # build_optimizer: part of this kit
    BUILT_FOR,
    NO_DECAY,
    build_optimizer,
    no_weight_decay,
    optimizer_built_for,
)
from trainer.state import TrainingState
from trainer.storage import limits

# ------------------------------------------------------------------ compile and optimizer
# Serving exports leave the optimizer out (its slots double or triple the size, and a
# server never trains). A context variable, not an argument, because the backends' save
# path is shared with checkpoints that always keep it; threads (an async checkpoint
# write running meanwhile) start with their own context and are not affected.
_INFERENCE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trainer_inference_only", default=False
)


@contextlib.contextmanager
def inference_only():
    """Saves inside this block store the model without its compile state and optimizer
    variables (it loads uncompiled, as an inference model)."""
    token = _INFERENCE_ONLY.set(True)
    try:
        yield
    finally:
        _INFERENCE_ONLY.reset(token)


def saving_optimizer() -> bool:
    """False inside ``inference_only()``: the save leaves out the compile state."""
    return not _INFERENCE_ONLY.get()


# ------------------------------------------------------------------ private copies
# Models no user code can reach: the async snapshot's shadow, which trainer alone changes,
# only by copying values in and ``trainable`` flags (``trainable.match_trainable``).
_PRIVATE_COPIES: weakref.WeakSet = weakref.WeakSet()


def mark_private_copy(model: keras.Model) -> None:
    """Declare ``model`` a private copy: from now on only values and ``trainable`` flags
    change in it (and its variables only by being replaced), which lets a backend check its
    structure by those alone between saves (the savedmodel backend's trace reuse)."""
    _PRIVATE_COPIES.add(model)


def is_private_copy(model: keras.Model) -> bool:
    return model in _PRIVATE_COPIES


def compile_config(model: keras.Model) -> dict[str, Any] | None:
    """The serialized arguments of ``model.compile``, or None if it was never compiled (or
    the save is ``inference_only``)."""
    if not getattr(model, "compiled", False) or not saving_optimizer():
        return None
    config = copy.deepcopy(model.get_compile_config())
    compile_objects.complete(config, training_compat.compile_arguments(model), model.name)
    if config.get("optimizer") is None and getattr(model, "optimizer", None) is not None:
        # Keras' legacy .h5 save pops "optimizer" from the live compile config (3.15,
        # legacy/saving/saving_utils.py); without this a reload would compile RMSprop.
        config["optimizer"] = keras.saving.serialize_keras_object(model.optimizer)
    recorded = {
        BUILT_FOR: optimizer_built_for(model),
        NO_DECAY: no_weight_decay(model),
        NO_LOSS_SCALING: _no_loss_scaling(model),
        TUPLES: _tuple_paths(model),
    }
    config.update({key: value for key, value in recorded.items() if value is not None})
    json.dumps(config)  # fail now, not in the middle of a write, if it is not JSON-able
    return config


# Compile-config key: True when ``compile(auto_scale_loss=False)`` kept a mixed_float16
# model's optimizer unwrapped. Keras leaves that argument out of its compile config, so a
# load compiling under the model's policy wrapped it in a LossScaleOptimizer (4 more
# variables: refused as damaged) instead of compiling what was trained.
NO_LOSS_SCALING = "trainer_no_loss_scaling"
# Compile-config key: where the structures given to ``compile`` (loss, metrics...) held
# tuples, which JSON stores as lists. A model with tuple outputs compiled from the lists
# raised a raw KeyError at its first training step, after a load that had succeeded.
TUPLES = "trainer_tuples"
# The compile arguments whose structure follows the model's outputs.
_STRUCTURED = ("loss", "loss_weights", "metrics", "weighted_metrics")
# Every key trainer records in a compile config beside Keras's own: a model Keras compiled
# from its config alone (a clone) lacks what they say, and must be compiled as a load does.
RECORDED_KEYS = (BUILT_FOR, NO_DECAY, NO_LOSS_SCALING, TUPLES)


def _tuple_paths(model: keras.Model) -> dict[str, list[list[str | int]]] | None:
    """For each structured compile argument, the paths (dict keys and list positions) of
    the tuples in it, deepest first; None if there is none anywhere."""
    arguments = training_compat.compile_arguments(model)
    found = {}
    for name in _STRUCTURED:
        paths: list[list[str | int]] = []
        _collect_tuples(arguments.get(name), [], paths)
        if paths:
            found[name] = sorted(paths, key=len, reverse=True)
    return found or None


def _collect_tuples(value: Any, path: list, paths: list) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _collect_tuples(item, [*path, key], paths)
    elif isinstance(value, list | tuple):
        if isinstance(value, tuple):
            paths.append(path)
        for index, item in enumerate(value):
            _collect_tuples(item, [*path, index], paths)


def _restore_tuples(kwargs: dict[str, Any], record: Any, where: Path) -> None:
    """Turn back into tuples the lists ``_tuple_paths`` recorded, deepest first (a tuple
    cannot take its converted children afterwards)."""
    if not isinstance(record, dict):
        raise CorruptCheckpointError(
            f"{where}: the compile config's {TUPLES!r} record must map argument names to "
            f"lists of paths; the checkpoint is damaged. Received: {str(record)[:200]}"
        )
    for name, paths in record.items():
        for path in paths if isinstance(paths, list) else [None]:
            try:
                parent, key = kwargs, name
                for step in path:
                    parent, key = parent[key], step
                parent[key] = tuple(parent[key])
            except (KeyError, IndexError, TypeError) as error:
                raise CorruptCheckpointError(
                    f"{where}: the compile config's {TUPLES!r} record names a path that its "
                    f"{name!r} argument does not have; the checkpoint is damaged. "
                    f"Received path {path!r} ({type(error).__name__})"
                ) from None


def _no_loss_scaling(model: keras.Model) -> bool | None:
    optimizer = getattr(model, "optimizer", None)
    mixed = getattr(model.dtype_policy, "name", None) == "mixed_float16"
    unwrapped = not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    return True if mixed and optimizer is not None and unwrapped else None


def compile_model(
    model: keras.Model,
    compile_config: dict[str, Any],
    *,
    custom_objects: dict[str, Any],
    safe_mode: bool,
    where: Path,
) -> None:
    """Compile ``model`` as saved, under ``safe_mode``; builds the optimizer.

    The stored config is what reached ``keras.Model.compile`` at save time. A class that
    overrides ``compile()`` may take other arguments (``compile(self, learning_rate)``) or
    derive its own from them, so its override is only trusted if, given the stored
    arguments, it compiles to the stored config again; otherwise ``keras.Model.compile``
    gets them, which reproduces the saved compile state. A class that overrides
    ``compile_from_config`` (Keras's hook for a custom compile) gets the config through it.
    """
    compile_config = dict(compile_config)
    built_for = compile_config.pop(BUILT_FOR, None)
    no_decay = compile_config.pop(NO_DECAY, None)
    scaling = {"auto_scale_loss": False} if compile_config.pop(NO_LOSS_SCALING, None) else {}
    tuples = compile_config.pop(TUPLES, None)
    if _overrides(model, "compile_from_config"):
        with keras.saving.custom_object_scope(custom_objects):
            try:
                model.compile_from_config({**copy.deepcopy(compile_config), **scaling})
            except Exception as error:
                raise rebuild.method_error(error, model, "compile_from_config", where) from error
        build_optimizer(model, built_for, where, no_decay=no_decay)
        return
    kwargs = deserialize(compile_config, custom_objects, safe_mode, where, "compile config")
    if tuples is not None:
        _restore_tuples(kwargs, tuples, where)
    kwargs.update(scaling)
    with keras.saving.custom_object_scope(custom_objects):  # names compile() looks up itself
        if not (_overrides(model, "compile") and _own_compile(model, kwargs, compile_config)):
            keras.Model.compile(model, **kwargs)
    build_optimizer(model, built_for, where, no_decay=no_decay)


def _overrides(model: keras.Model, method: str) -> bool:
    return getattr(type(model), method, None) is not getattr(keras.Model, method)


def _own_compile(model: keras.Model, kwargs: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether the class's own ``compile()``, given the stored arguments, compiled the model
    to the stored config (so whatever else it sets up is set up too)."""
    try:
        inspect.signature(model.compile).bind(**kwargs)
        model.compile(**copy.copy(kwargs))
        again = {k: v for k, v in compile_config(model).items() if k not in RECORDED_KEYS}
        return json.loads(json.dumps(again)) == stored
    except Exception:  # another signature, or it fails on these arguments: not usable
        return False


# ------------------------------------------------------------------ variables
def optimizer_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """(path, value) of every optimizer variable, in the optimizer's own order."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    build_optimizer(model)
    return [(v.path, np.asarray(keras.ops.convert_to_numpy(v))) for v in optimizer.variables]


def restore_optimizer_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    """Assign saved optimizer values by position, checking count and shapes."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        if arrays:
            raise CorruptCheckpointError(
                f"{where} holds {len(arrays)} optimizer variables but no compile config to "
                f"rebuild the optimizer from. The checkpoint is inconsistent; re-save it."
            )
        return
    build_optimizer(model)
    assign_by_position(
        optimizer.variables, arrays, where, f"optimizer variables ({type(optimizer).__name__})"
    )


def model_weight_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """(path, value) of every model weight (trainable and non-trainable, no RNG seeds)."""
    return [(v.path, np.asarray(keras.ops.convert_to_numpy(v))) for v in model.weights]


def restore_model_weight_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    assign_by_position(model.weights, arrays, where, "model variables")


def rng_state_arrays(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """(path, value) of the model's RNG seed states (Dropout etc.), absent from ``weights``.

    Keras draws a fresh random seed for every rebuilt layer and ``save_weights`` skips these
    variables, so without them a resumed run would drop out different units.
    """
    return [(v.path, np.asarray(keras.ops.convert_to_numpy(v))) for v in _rng_variables(model)]


def restore_rng_state_arrays(model: keras.Model, arrays: list[np.ndarray], where: str) -> None:
    assign_by_position(_rng_variables(model), arrays, where, "RNG seed states")


def assign_by_position(variables: list, arrays: list[np.ndarray], where: str, what: str) -> None:
    """Assign ``arrays`` to ``variables`` in order, refusing any count or shape mismatch."""
    if len(variables) != len(arrays):
        raise CorruptCheckpointError(
            f"{where} holds {len(arrays)} {what} but the model rebuilt from its config has "
            f"{len(variables)}. The checkpoint is damaged or was edited; load an older one."
        )
    for variable, value in zip(variables, arrays, strict=True):
        if tuple(variable.shape) != tuple(value.shape):
            raise CorruptCheckpointError(
                f"{where}: variable {variable.path!r} (among the {what}) has shape "
                f"{tuple(variable.shape)} but the checkpoint holds shape {tuple(value.shape)}. "
                f"The checkpoint is damaged or was edited."
            )
        variable.assign(value)


def _rng_variables(model: keras.Model) -> list:
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


# ------------------------------------------------------------------ architecture
# Beside Keras' own keys in a stored architecture: the model's dtype policy (``policies``).
MODEL_POLICY = "trainer_dtype_policy"


def model_config(model: keras.Model) -> dict[str, Any]:
    """The model's architecture (with build and compile config, and its dtype policy under
    ``MODEL_POLICY``) as a JSON-able dict."""
    try:
        config = keras.saving.serialize_keras_object(model)
        config[MODEL_POLICY] = dtype_policy.serialized_policy(model)
        json.dumps(config)
    except (NotImplementedError, TypeError, ValueError) as error:
        raise ModelNotReadyError(
            f"Model {model.name!r} cannot be described as a config, so it could not be "
            f"rebuilt on load. Give custom layers and models a get_config() returning their "
            f"constructor arguments, and register them with "
            f"@keras.saving.register_keras_serializable(). Received error: {error}"
        ) from error
    return config


def rebuild_model(
    config: dict[str, Any],
    compile_config: dict[str, Any] | None,
    *,
    custom_objects: dict[str, Any],
    safe_mode: bool,
    compile: bool,
    where: Path,
) -> keras.Model:
    """Deserialize the architecture, build it, and compile it as saved (if ``compile``)."""
    if not isinstance(config, dict) or not (
        compile_config is None or isinstance(compile_config, dict)
    ):
        raise CorruptCheckpointError(
            f"{where}: the stored architecture and compile config must be JSON objects; the "
            f"checkpoint is damaged. Load an older checkpoint. Received "
            f"{type(config).__name__} and {type(compile_config).__name__}"
        )
    limits.check_structure(config, "architecture", where, dimensions=True)
    policy = dtype_policy.stored_policy(config.get(MODEL_POLICY))
    config = {k: v for k, v in config.items() if k not in ("compile_config", MODEL_POLICY)}
    with dtype_policy.global_policy(policy):  # the model's policy, its optimizer as compiled
        model = deserialize(config, custom_objects, safe_mode, where, "model")
        if not isinstance(model, keras.Model) or not model.built:
            raise CorruptCheckpointError(
                f"{where}: the stored architecture did not rebuild into a built Keras model "
                f"(no build config?). Re-save the checkpoint from a built model. "
                f"Received: {type(model).__name__}, built={getattr(model, 'built', None)}"
            )
        if compile and compile_config:
            compile_model(
                model, compile_config, custom_objects=custom_objects, safe_mode=safe_mode,
                where=where,
            )  # fmt: skip
    return model


def own_classes(model: keras.Model) -> dict[str, type]:
    """The classes of a built model that are not Keras's own, by the names a checkpoint
    records them under (the registered ``package>Name`` and the bare class name): what a
    load of a checkpoint of that same model needs as ``custom_objects``. Taken from objects
    the caller already built, so no code named by a checkpoint is imported."""
    found: dict[str, type] = {}
    for layer in keras_compat.sublayers(model, include_self=True):
        cls = type(layer)
        if cls.__module__.split(".")[0] == "keras":
            continue
        found.setdefault(cls.__name__, cls)
        found.setdefault(keras.saving.get_registered_name(cls), cls)
    return found


# ------------------------------------------------------------------ stored documents
def to_json(value: Any, what: str) -> str:
    """``value`` as JSON, keys in their order (a Keras config's dict of outputs is ordered)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise SaveError(
            f"The {what} to store in the checkpoint is not JSON-serializable; pass plain "
            f"dicts, lists, strings and numbers (convert OmegaConf configs with "
            f"OmegaConf.to_container). Received error: {error}"
        ) from error


def from_json(text: str, what: str, where: Path) -> Any:
    """Parse a stored JSON document, bounded in size and nesting (``trainer.storage.limits``)."""
    limits.check_text_size(len(text), what, where)
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{where}: the stored {what} is not valid JSON; the checkpoint is damaged. "
            f"Load an older checkpoint. Received error: {type(error).__name__}: {error}"
        ) from error
    limits.check_structure(value, what, where, dimensions=False)
    return value


def parse_state(text: str, where: Path) -> TrainingState:
    return checkpoint_state(from_json(text, "training state", where), where)


STATE_KEYS = ("epoch", "step_in_epoch", "global_step")


def checkpoint_state(data: Any, where: Path | str) -> TrainingState:
    """The stored training state, which must name its counters: a state that silently fell
    back to zeros would restart a resumed run from the beginning."""
    missing = [k for k in STATE_KEYS if k not in data] if isinstance(data, dict) else STATE_KEYS
    try:
        if missing:
            raise ValueError(f"missing {list(missing)}")
        return TrainingState.from_dict(data)
    except (TypeError, ValueError) as error:
        raise CorruptCheckpointError(
            f"{where}: the stored training state is invalid; the checkpoint is damaged or "
            f"was written by a newer trainer. Load an older checkpoint. Received error: {error}"
        ) from error
