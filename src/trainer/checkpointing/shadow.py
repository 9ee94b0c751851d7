"""The shadow model async snapshots are written from: a copy of the model rebuilt from its
config, with its own variables, compiled like it (``clone_for_snapshot``), or the reason
none can be made (``SnapshotUnavailable``: the saves are then written synchronously, with
a warning saying why and what to do).
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras

from trainer._compat import call_records, live_objects
from trainer._compat.keras import sublayers
from trainer._compat.keras_inputs import get_input_signature
from trainer.errors import SaveError
from trainer.model_state import dtype_policy, kit, readiness


def all_variables(model: keras.Model) -> list:
    """Every variable whose value a checkpoint holds.

    Args:
        model: A built Keras model.

    Returns:
        Its weights, RNG seed states, optimizer variables and metric variables, in a fixed
        order (two models of one architecture pair up by position).
    """
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = list(optimizer.variables) if optimizer is not None else []
    return [*model.variables, *optimizer_variables]


class SnapshotUnavailable(SaveError):
    """No shadow of the model can be built from its config: its saves are written
    synchronously instead (``AsyncBackend``), with a warning saying why."""


def clone_for_snapshot(model: keras.Model) -> keras.Model:
    """A second model of the same architecture and compile state, with its own variables,
    built under the model's own dtype policy (``policies``: a mixed-precision model keeps
    its ``LossScaleOptimizer`` whatever the global policy is now).

    The config is the live model's, serialized a moment ago in this process: it is rebuilt
    outside safe mode (a ``Lambda``'s code is the model's own), unless a layer was revived
    from traced functions (its config is the one its checkpoint stored), and with every
    class of the model at hand, registered or not.

    Args:
        model: A built (and usually compiled) Keras model.

    Returns:
        The copy, built and compiled as ``model`` is; its values are not copied
        (``refresh_snapshot`` does that).

    Raises:
        SnapshotUnavailable: The model cannot be rebuilt from its config (a layer holding a
            plain Python object, ...); a ``SaveError``. ``AsyncBackend`` catches it and
            writes that model's saves synchronously, with one warning.
    """
    try:
        with dtype_policy.global_policy(getattr(model, "dtype_policy", None)):
            clone = _rebuilt_and_compiled(model)
    except Exception as error:  # whatever the model's own code raises
        raise _copy_failed(model, error) from error
    call_records.share(model, clone)  # its saves try only what the model was called on
    mine, theirs = all_variables(model), all_variables(clone)
    if [tuple(v.shape) for v in mine] != [tuple(v.shape) for v in theirs]:
        raise SnapshotUnavailable(
            f"Async saving keeps a copy of model {model.name!r} rebuilt from its config and "
            f"copies the variables into it by position, but the copy's variables differ from "
            f"the original's ({_difference(mine, theirs)}), so its checkpoints are written "
            f"synchronously. Set checkpoint.policy.async_save=false to silence this. Received: "
            f"{len(mine)} variables in the model, {len(theirs)} in the copy"
        )
    return clone


def _described(variable: Any) -> tuple[str, list, str]:
    path = getattr(variable, "path", None) or getattr(variable, "name", "?")
    return str(path), list(variable.shape), str(variable.dtype)


def _difference(mine: list, theirs: list) -> str:
    """What differs: the number of variables, or the same variables created in another
    order (a model quantized in place makes its quantization variables after its weights;
    one rebuilt quantized, before them), or other variables; with the first position
    where they differ."""
    if len(mine) != len(theirs):
        return f"{len(mine)} variables in the model, {len(theirs)} in the copy"
    pairs = enumerate(zip(mine, theirs, strict=True))
    first = next(i for i, (a, b) in pairs if a.shape != b.shape)
    if sorted(map(str, map(_described, mine))) == sorted(map(str, map(_described, theirs))):
        what = f"the same {len(mine)} variables, created in another order"
    else:
        what = f"{len(mine)} variables each, not the same names, shapes or dtypes"
    return (
        f"{what}: variable {first} is {_described(mine[first])} in the model, "
        f"{_described(theirs[first])} in the copy"
    )


def _copy_failed(model: keras.Model, error: Exception) -> SnapshotUnavailable:
    """Why no copy could be made. A layer revived from traced functions (its class was
    missing at load) is rebuilt from the config its checkpoint stored, which names that
    class: the class is what is missing, not a registration of a class the user has."""
    received = f"Received {type(error).__name__}: {str(error)[:300]}"
    revived = readiness.revived_layers(model)
    if revived:
        first = revived[0]
        original = live_objects.get_marker(first, live_objects.ORIGINAL_IDENTITY) or {}
        source = live_objects.get_marker(first, live_objects.REVIVED_FROM)
        cls = original.get("registered_name") or original.get("class_name") or "its class"
        if type(first).__name__ == "LegacyLambda" or original.get("carries_code"):
            why = "its stored Python code was not run (a Lambda), and the copy runs none either"
            remedy = "load the checkpoint with safe_mode=False if you trust it"
        else:
            why = f"its class {cls!r} was not available when the checkpoint was loaded"
            remedy = (
                f"load the checkpoint where the class is importable (or pass "
                f"custom_objects={{{original.get('class_name', cls)!r}: cls}})"
            )
        return SnapshotUnavailable(
            f"Async saving keeps a copy of model {model.name!r} rebuilt from its config, but "
            f"layer {first.name!r} was revived from the traced functions of "
            f"{source} ({why}): it cannot be rebuilt from its config. Its "
            f"checkpoints are written synchronously (training waits for each write) and "
            f"still hold the traced functions. To save asynchronously, {remedy}; or set "
            f"checkpoint.policy.async_save=false to silence this. {received}"
        )
    return SnapshotUnavailable(
        f"Async saving keeps a copy of model {model.name!r} rebuilt from its config, and "
        f"that copy could not be made, so its checkpoints are written synchronously "
        f"(training waits for each write). Make the model's classes rebuildable from "
        f"get_config() (keras.saving.register_keras_serializable), or set "
        f"checkpoint.policy.async_save=false to silence this. {received}"
    )


def _rebuilt_and_compiled(model: keras.Model) -> keras.Model:
    # A layer revived from traced functions returns the config its checkpoint stored: data
    # from a file, which may hold a Lambda's bytecode (the load ran none of it). Such a
    # model is copied in safe mode; one built in this process, outside it.
    safe_mode = bool(readiness.revived_layers(model))
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(model),
        custom_objects=_classes_of(model),
        safe_mode=safe_mode,
    )
    kit.mark_private_copy(clone)  # only trainer changes it, and only so
    _call_once_like(model, clone)
    kit.build_optimizer(model)
    compile_config = kit.compile_config(model)
    if compile_config and any(k in compile_config for k in kit.RECORDED_KEYS):
        # Keras compiled the clone from its config and built the optimizer for its
        # trainable variables, deciding weight decay and loss scaling by the config
        # alone: compile it again the way a load does, which builds a fresh optimizer
        # like the model's.
        where = f"the async copy of model {model.name!r}"
        kit.compile_model(
            clone, compile_config, custom_objects={}, safe_mode=safe_mode, where=where
        )
    return clone


def _classes_of(model: keras.Model) -> dict[str, type]:
    """Every layer class in ``model`` (the model's own included) under the name its
    config records for it (``registered_name``: the class name if it is not registered),
    so that unregistered classes are found. A name two classes share is left out: Keras
    then looks it up as usual (and, failing, the saves are synchronous)."""
    classes: dict[str, type] = {}
    shared: set[str] = set()
    for layer in sublayers(model, include_self=True):
        cls = type(layer)
        name = keras.saving.get_registered_name(cls)
        if classes.setdefault(name, cls) is not cls:
            shared.add(name)
    return {name: cls for name, cls in classes.items() if name not in shared}


def _call_once_like(model: keras.Model, clone: keras.Model) -> None:
    """A subclassed model knows its input signature (which the SavedModel backend traces
    with) only once called: call the fresh clone once, symbolically (no op runs), on
    inputs shaped and typed like the live model's. Keras types them with the model's float
    dtype, whatever it takes: a model taking strings cannot run on float zeros (the call
    they were given failed, and with it every async save). Graph models (Functional,
    Sequential) know theirs already. A model that cannot be called so stays uncalled: the
    backend then takes the shapes Keras recorded when it was built."""
    try:
        get_input_signature(clone)
        return
    except ValueError:
        pass
    try:
        signature = get_input_signature(model)
    except ValueError:
        return  # the live model was never called either: the backend says so when saving
    with contextlib.suppress(Exception):  # the model's own call: anything
        clone(*keras.tree.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype), signature))
