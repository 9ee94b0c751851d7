"""Compile an imported model as its legacy ``training_config`` says, and restore the
optimizer's state where the legacy checkpoint holds it.

Keras 2 optimizer configs carry options Keras 3 dropped (``jit_compile``,
``is_legacy_optimizer``) and ``Custom>`` class prefixes; losses may carry
``reduction="auto"``, which Keras 3 calls ``sum_over_batch_size``.
"""

from __future__ import annotations

import logging
from typing import Any

import keras

from trainer.errors import UnsupportedLegacyError
from trainer.save_backends.legacy import slots, translate
from trainer.save_backends.legacy.reader import LegacyDir

log = logging.getLogger(__name__)
_OPTIMIZER_DROPPED = ("jit_compile", "is_legacy_optimizer", "decay")
# tf_keras' mixed-precision wrappers (of tf.keras.optimizers.* and of the legacy ones).
_LOSS_SCALE = ("LossScaleOptimizerV3", "LossScaleOptimizer")
# Keras 2's built-in learning-rate schedules; Keras 3 has each under the same name.
_SCHEDULES = (
    "ExponentialDecay",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "InverseTimeDecay",
    "CosineDecay",
    "CosineDecayRestarts",
)


def optimizer_from(config: dict[str, Any] | None, where: str) -> keras.optimizers.Optimizer:
    """The Keras 3 optimizer of a legacy ``optimizer_config``."""
    if not config:
        return keras.optimizers.RMSprop()  # Keras' own default for compile()
    config = translate.plain(config)
    class_name = str(config.get("class_name", "")).split(">")[-1]
    options = dict(config.get("config") or {})
    if class_name in _LOSS_SCALE:
        return _loss_scale_optimizer(class_name, options, where)
    if options.get("decay") not in (None, 0, 0.0):
        raise UnsupportedLegacyError(
            f"The optimizer of {where} ({class_name}) uses the legacy decay="
            f"{options['decay']!r}, which Keras 3 optimizers do not have; use a learning "
            f"rate schedule instead. Received: decay={options['decay']!r}"
        )
    for key in _OPTIMIZER_DROPPED:
        options.pop(key, None)
    if "lr" in options:
        options["learning_rate"] = options.pop("lr")
    if "learning_rate" in options:
        options["learning_rate"] = _schedule(options["learning_rate"], class_name, where)
    try:
        return keras.optimizers.get({"class_name": class_name, "config": options})
    except (ValueError, TypeError) as error:
        raise UnsupportedLegacyError(
            f"The optimizer of {where} ({class_name}) cannot be rebuilt in Keras 3 "
            f"({_brief(error)}). Load with compile=False and compile the imported model "
            f"yourself. Received: {class_name!r}"
        ) from error


def _loss_scale_optimizer(class_name: str, options: dict, where: str) -> Any:
    """A mixed-precision model's ``LossScaleOptimizer(V3)`` -> Keras 3's, around the inner
    optimizer translated: Keras 3's is tf_keras' dynamic loss scaling (double the scale after
    ``dynamic_growth_steps`` finite steps, halve it on a non-finite one); a fixed scale
    (``dynamic=False``) has no counterpart."""
    if options.get("dynamic", True) is not True:
        raise UnsupportedLegacyError(
            f"The optimizer of {where} ({class_name}) uses a fixed loss scale "
            f"(dynamic=False); Keras 3's LossScaleOptimizer always adjusts its scale, so "
            f"training would scale gradients otherwise. Load with compile=False and compile "
            f"the imported model yourself. Received: dynamic={options.get('dynamic')!r}"
        )
    inner = optimizer_from(options.get("inner_optimizer"), where)
    return keras.optimizers.LossScaleOptimizer(
        inner,
        initial_scale=options.get("initial_scale", 2.0**15),
        dynamic_growth_steps=options.get("dynamic_growth_steps", 2000),
    )


def _schedule(value: Any, optimizer: str, where: str) -> Any:
    """A Keras 2 learning-rate schedule config -> Keras 3's class of the same name (the
    same arguments and formulas: tf_keras 2.21's and Keras 3.15.1's source); a number stays
    as it is."""
    if not isinstance(value, dict):
        return value
    name = str(value.get("class_name", "")).split(">")[-1]
    if name not in _SCHEDULES:
        raise UnsupportedLegacyError(
            f"The optimizer of {where} ({optimizer}) uses the learning-rate schedule "
            f"{name!r}, which the import cannot rebuild (it translates Keras' built-in "
            f"schedules: {', '.join(_SCHEDULES)}). Load with compile=False and compile the "
            f"imported model with a Keras 3 schedule. Received: {name!r}"
        )
    config = dict(value.get("config") or {})
    if config.get("name") is None:  # Keras 2's default; Keras 3's name scope needs a string
        config.pop("name", None)
    try:
        return getattr(keras.optimizers.schedules, name).from_config(config)
    except (ValueError, TypeError) as error:
        raise UnsupportedLegacyError(
            f"The learning-rate schedule {name!r} of the optimizer of {where} cannot be "
            f"rebuilt in Keras 3 ({_brief(error)}). Load with compile=False and compile the "
            f"imported model yourself. Received: {value.get('config')!r}"
        ) from error


def _brief(error: BaseException) -> str:
    """An error's first line, cut short: Keras' deserialization errors dump whole configs."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def _loss(value: Any) -> Any:
    if isinstance(value, dict) and "class_name" in value:
        config = dict(value.get("config") or {})
        if config.get("reduction") == "auto":
            config["reduction"] = "sum_over_batch_size"
        config.pop("fn", None)
        return keras.losses.get({"class_name": value["class_name"], "config": config})
    if isinstance(value, list):
        return [_loss(v) for v in value]
    if isinstance(value, dict):
        return {k: _loss(v) for k, v in value.items()}
    return value


_BY_NAME = ("accuracy", "acc", "crossentropy", "ce")


def _metrics(value: Any, output_names: list[str]) -> Any:
    """The compile ``metrics`` of a legacy config, under the names tf_keras logged them
    with. Keras 2 recorded a multi-output model's metrics as one list per output, their
    names prefixed with the output's (``reg_mae``); Keras 3 adds that prefix itself, so it
    is taken off (it was logged twice: ``reg_reg_root_mean_squared_error``)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        names = [f"{n}_" for n in output_names] + [""] * len(value)
        return [_metric(v, prefix) for v, prefix in zip(value, names, strict=False)]
    return _metric(value, "")


def _metric(value: Any, prefix: str) -> Any:
    """Keras 2 wraps built-in metric functions as ``MeanMetricWrapper{fn, name}``; Keras 3
    takes their names when they are Keras 3 names of the same function (``"mae"``: logged
    as ``mae``; ``"accuracy"`` still picks the variant the loss implies), else the
    function's name."""
    if isinstance(value, list):
        return [_metric(v, prefix) for v in value]
    if isinstance(value, dict) and value.get("class_name") == "MeanMetricWrapper":
        config = value.get("config") or {}
        name = _unprefixed(config.get("name"), prefix)
        fn = config.get("fn")
        return name if name in _BY_NAME or _same_function(name, fn) else fn
    if isinstance(value, dict) and "class_name" in value:
        config = dict(value.get("config") or {})
        if "name" in config:
            config["name"] = _unprefixed(config["name"], prefix)
        return keras.metrics.get({"class_name": value["class_name"], "config": config})
    if isinstance(value, dict):
        return {k: _metric(v, f"{k}_") for k, v in value.items()}
    return value


def _unprefixed(name: Any, prefix: str) -> Any:
    if prefix and isinstance(name, str) and name.startswith(prefix) and name != prefix:
        return name[len(prefix) :]
    return name


def _same_function(name: Any, fn: Any) -> bool:
    """Whether Keras 3 resolves ``name`` (an alias such as ``mae``) to the function that
    Keras 2 recorded as ``fn``."""
    if not isinstance(name, str) or not isinstance(fn, str):
        return False
    try:
        return _resolved(name) is _resolved(fn)
    except (ValueError, TypeError):  # not a Keras 3 metric name
        return False


def _resolved(name: str) -> Any:
    found = keras.metrics.get(name)  # a new instance of a class, or a function
    return type(found) if isinstance(found, keras.metrics.Metric) else found


def compile_from_legacy(
    model: keras.Model, legacy: LegacyDir, training_config: dict[str, Any], objects: dict
) -> dict[str, Any]:
    """Compile ``model``; restore optimizer state; return what the metadata records."""
    where = str(legacy.path)
    config = translate.plain(training_config)
    optimizer = optimizer_from(config.get("optimizer_config"), where)
    outputs = list(getattr(model, "output_names", None) or [])
    try:
        with keras.saving.custom_object_scope(objects):
            model.compile(
                optimizer=optimizer,
                loss=_loss(config.get("loss")),
                metrics=_metrics(config.get("metrics"), outputs),
                weighted_metrics=_metrics(config.get("weighted_metrics"), outputs),
                loss_weights=config.get("loss_weights"),
            )
    except (ValueError, TypeError) as error:
        raise UnsupportedLegacyError(
            f"The compile arguments of {where} cannot be used in Keras 3 ({error}). Load "
            f"with compile=False and compile the model yourself. Received: "
            f"{ {k: config.get(k) for k in ('loss', 'metrics')} }"
        ) from error
    return {"optimizer_state": slots.restore(model, legacy)}
