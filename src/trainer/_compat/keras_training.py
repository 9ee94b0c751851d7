"""Keras internals of training that trainer needs and Keras 3 exposes no public API for:
the optimizer's per-variable state and step counts, what ``compile`` was given, and where
``fit`` starts and finalizes.

Same rules as ``trainer._compat.keras``: each helper names the private attribute it uses,
why no public API does the job, and the version it was checked against (Keras 3.15.1,
TensorFlow backend); ``tests/_compat/test_canaries.py`` checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """Make the ``fit`` that is starting begin at ``epoch`` (None: as its caller asked).

    Sets ``model._initial_epoch``, which ``fit`` reads right after ``on_train_begin``
    (``initial_epoch = self._initial_epoch or initial_epoch``): the only way a callback can
    move the start of a ``fit`` it did not call. Keras' own ``BackupAndRestore`` does the
    same; no public API exists. Checked: Keras 3.15.1, TensorFlow backend.
    """
    model._initial_epoch = epoch


def optimizer_slot_list(optimizer: Any, attribute: str) -> list[Any] | None:
    """One kind of an optimizer's per-variable state (``_momentums`` of ``Adam``), aligned
    with the trainable variables it was built for; None if it has no such list.

    Reads the optimizer's private attribute of that name: Keras has no public API that
    says which optimizer variable belongs to which model variable (``optimizer.variables``
    is a flat list). Checked: Keras 3.15.1 (adam.py, sgd.py, rmsprop.py).
    """
    found = getattr(optimizer, attribute, None)
    return list(found) if isinstance(found, list | tuple) else None


def optimizer_built_for(optimizer: Any) -> list[Any]:
    """The model variables ``optimizer`` was built for, in its slot lists' order.

    Uses ``BaseOptimizer._trainable_variables``. Checked: Keras 3.15.1.
    """
    return list(optimizer._trainable_variables)


def batches_trained(optimizer: Any) -> Any:
    """How many batches ``optimizer`` has been applied on (a scalar tensor).

    ``iterations`` counts optimizer steps; with ``gradient_accumulation_steps`` Keras
    divides the batch count by them, so two saves one batch apart would read the same step
    and differ in their accumulated gradients. The batch count itself is the private
    ``BaseOptimizer._iterations`` (a ``LossScaleOptimizer`` keeps it in its inner one).
    Read only where accumulation is on; the public ``iterations`` otherwise. Checked:
    Keras 3.15.1 (base_optimizer.py).
    """
    inner = innermost_optimizer(optimizer)
    if getattr(inner, "gradient_accumulation_steps", None):
        return inner._iterations
    return optimizer.iterations


def before_finalizing(optimizer: Any, hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` when ``fit`` is about to finalize ``optimizer``'s variables; returns
    the function that removes the hook.

    ``fit`` ends by calling ``optimizer.finalize_variable_values``, which, with
    ``use_ema``, replaces the model's weights by their moving averages, after the last
    ``on_epoch_end`` and before ``on_train_end``; no callback method runs in between. A
    save at ``on_train_end`` would store the averages as the weights training continues
    from. This shadows the method on the instance (public name; Keras's fit looks it up
    there). Checked: Keras 3.15.1, backend/tensorflow/trainer.py.
    """
    original = optimizer.finalize_variable_values

    def finalize_variable_values(var_list):
        hook()
        return original(var_list)

    optimizer.finalize_variable_values = finalize_variable_values

    def remove() -> None:
        if optimizer.__dict__.get("finalize_variable_values") is finalize_variable_values:
            del optimizer.finalize_variable_values

    return remove


def compile_arguments(model: Any) -> dict[str, Any]:
    """The arguments ``model.compile`` was called with, as given (tuples still tuples).

    ``get_compile_config`` serializes them to JSON-like values, where a tuple becomes a
    list; a model whose outputs are a tuple then fails to train on a list-structured loss
    (Keras matches the two structures by type). Reads ``Trainer._compile_config.config``,
    the ``SerializableDict`` ``compile`` fills; there is no public accessor. Checked:
    Keras 3.15.1, trainers/trainer.py. Empty if the model was not compiled by Keras.
    """
    stored = getattr(model, "_compile_config", None)
    config = getattr(stored, "config", None)
    return dict(config) if isinstance(config, dict) else {}


def wrapped_function_arguments(obj: Any) -> dict[str, Any]:
    """The keyword arguments a loss or metric that wraps a function passes to it on every
    call (``LossFunctionWrapper`` and ``MeanMetricWrapper`` keep them in ``_fn_kwargs``):
    what the object computes with, whether or not its ``get_config`` records them (Keras
    3.15's ``Huber`` leaves out ``delta``). No public accessor. Checked: Keras 3.15.1,
    losses/losses.py and metrics/reduction_metrics.py. Empty for any other object."""
    arguments = getattr(obj, "_fn_kwargs", None)
    return dict(arguments) if isinstance(arguments, dict) else {}


def innermost_optimizer(optimizer: Any) -> Any:
    """The optimizer that does the updates: ``optimizer`` itself, or the one a
    ``LossScaleOptimizer`` wraps (public ``inner_optimizer``), recursively."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def uses_weight_decay(optimizer: Any, variable: Any) -> bool:
    """Whether ``optimizer`` applies its weight decay to ``variable`` (False for those
    ``exclude_from_weight_decay`` left out, by variable or by name pattern).

    Uses ``BaseOptimizer._use_weight_decay``: Keras stores the exclusions in private
    attributes, outside ``get_config``, and has no public query. Checked: Keras 3.15.1.
    """
    return bool(optimizer._use_weight_decay(variable))
