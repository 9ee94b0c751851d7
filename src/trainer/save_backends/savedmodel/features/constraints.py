"""Weight constraints (``add_weight(constraint=NonNeg())``), which no traced function holds.

Keras applies a variable's constraint in the optimizer, after each update, not in the
layer's call: a layer revived from its traces (class missing at load) owns variables
that would train unconstrained, silently. So each variable's constraint is recorded by its
Keras config, and set again on the revived layer's variables. A constraint that has no
config cannot be revived and is refused at save time; one whose class is missing at load
(a custom constraint not imported) is refused at load, naming it.
"""

from __future__ import annotations

import json
from typing import Any

import keras

from trainer.errors import MissingClassError, ModelNotReadyError


def config(variable: Any) -> dict[str, Any] | None:
    """The Keras config of ``variable``'s constraint (None without one);
    ModelNotReadyError if it has no config."""
    constraint = getattr(variable, "constraint", None)
    if constraint is None:
        return None
    try:
        stored = keras.saving.serialize_keras_object(constraint)
        json.dumps(stored)
    except Exception as err:  # the constraint's own get_config
        raise ModelNotReadyError(
            f"Variable {getattr(variable, 'path', variable.name)!r} has a constraint whose "
            f"config cannot be stored ({type(err).__name__}: {str(err)[:200]}). Keras "
            f"applies it in the optimizer, so no traced function holds it, and a layer "
            f"revived without its class would train unconstrained. Use a Keras constraint "
            f"or a registered keras.constraints.Constraint subclass with get_config. "
            f"Received: {constraint!r}"[:900]
        ) from err
    if not isinstance(stored, dict | str):
        raise ModelNotReadyError(
            f"Variable {getattr(variable, 'path', variable.name)!r} has a constraint that "
            f"is not a keras.constraints.Constraint (a plain function), which cannot be "
            f"restored on a layer revived without its class. Wrap it in a registered "
            f"Constraint subclass. Received: {constraint!r}"[:600]
        )
    return stored


def restore(
    variables: list[tuple[dict[str, Any], keras.Variable]],
    *,
    layer: str,
    custom_objects: dict[str, Any],
    safe_mode: bool,
    where: str,
) -> None:
    """Set each recorded constraint on the revived layer's variable (record, variable)."""
    for record, variable in variables:
        stored = record.get("constraint")
        if stored is None:
            continue
        try:
            with keras.saving.custom_object_scope(custom_objects):
                variable.constraint = keras.saving.deserialize_keras_object(
                    stored, custom_objects=custom_objects, safe_mode=safe_mode
                )
        except Exception as err:  # an unknown class, or its from_config failing
            raise MissingClassError(
                f"{where}: layer {layer!r} is revived from its traced functions (its class "
                f"is missing), and its variable {record.get('path')!r} has a constraint "
                f"that cannot be rebuilt here ({type(err).__name__}: {str(err)[:200]}): "
                f"it would train unconstrained. Import or register the constraint's class "
                f"(or pass it in custom_objects), or the layer's class. "
                f"Received: {json.dumps(stored)[:300]}"
            ) from err
