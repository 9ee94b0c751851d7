"""Which variables a model's optimizer is built for and decays, and which layers are
trainable: optimizer state that Keras keeps outside the optimizer's config.

Keras builds an optimizer once, for the variables trainable at the first training step,
and keeps it so when a layer is frozen or unfrozen later (fine-tuning then calls
``compile`` with the same optimizer); ``exclude_from_weight_decay`` is a call, not a
config entry. A checkpoint records both as positions in ``model.weights``
(:func:`optimizer_built_for`, :func:`no_weight_decay`), and a load, a resume into a fresh
model or an async snapshot builds the optimizer alike (:func:`build_optimizer`) and
copies the ``trainable`` flags (:func:`match_trainable`).
"""

from __future__ import annotations

from typing import Any

import keras

from trainer._compat import keras as keras_compat
from trainer._compat import keras_training as training_compat
from trainer.errors import CorruptCheckpointError, SaveError

# Keys of the compile config (never passed to ``compile``) holding optimizer_built_for
# and no_weight_decay.
BUILT_FOR = "trainer_optimizer_built_for"
NO_DECAY = "trainer_no_weight_decay"


def optimizer_built_for(model: keras.Model) -> list[int] | None:
    """Positions in ``model.weights`` of the variables the optimizer was built for, when
    they are not ``model.trainable_variables`` now, else None (also when unbuilt).

    Keras builds an optimizer once, for the variables trainable at the first step; a layer
    frozen or unfrozen later (then ``compile`` with the same optimizer, as fine-tuning
    does) leaves its slots as they were. A load building the optimizer for the trainable
    variables it finds would get another count of slots (refused as damaged) or, with
    the same count and shapes, put every slot on the wrong variable without a word.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    try:
        tracked = training_compat.optimizer_built_for(optimizer)
    except AttributeError:  # not a Keras BaseOptimizer: built for the trainable variables
        return None
    if [id(v) for v in tracked] == [id(v) for v in model.trainable_variables]:
        return None
    float8 = float8_layers(model)
    if float8:  # positions cannot name its variables: a rebuild orders them otherwise
        raise SaveError(
            f"The optimizer of model {model.name!r} was built before model.quantize('float8') "
            f"added variables to layers {float8[:5]}; Keras rebuilds those layers from their "
            f"config with their variables in another order, so no load could rebuild this "
            f"optimizer. Compile the model with a new optimizer instance first. Received: "
            f"{len(tracked)} variables the optimizer was built for"
        )
    positions = {id(v): i for i, v in enumerate(model.weights)}
    strangers = [v.path for v in tracked if id(v) not in positions]
    if strangers:
        raise SaveError(
            f"The optimizer of model {model.name!r} was built for variables that are no "
            f"longer the model's weights (replaced since, as model.quantize() does), so no "
            f"load could rebuild it. Compile the model with a new optimizer instance first. "
            f"Received: {strangers[:5]}"
        )
    return [positions[id(v)] for v in tracked]


def float8_layers(model: keras.Model) -> list[str]:
    """Names of the layers ``model.quantize("float8")`` quantized. Keras rebuilds such a
    layer from its config with its variables in another order than the live layer's
    (scales before the kernel), so no position recorded on the live model names the same
    variable after a load."""
    return [
        layer.name
        for layer in keras_compat.sublayers(model, include_self=True)
        if isinstance(layer.dtype_policy, keras.dtype_policies.QuantizedFloat8DTypePolicy)
    ]


def no_weight_decay(model: keras.Model) -> list[int] | None:
    """Positions in ``model.weights`` of the variables the optimizer leaves out of weight
    decay (``exclude_from_weight_decay``, by variable or by name), or None when it has no
    weight decay or decays every variable. Keras keeps that choice out of the optimizer's
    config: a load from the config alone would decay them, and train differently."""
    optimizer = getattr(model, "optimizer", None)
    # A LossScaleOptimizer has no weight decay of its own: its inner optimizer decays.
    decaying = training_compat.innermost_optimizer(optimizer) if optimizer is not None else None
    if decaying is None or not getattr(decaying, "weight_decay", None):
        return None
    try:
        candidates = (
            training_compat.optimizer_built_for(optimizer)
            if optimizer.built
            else list(model.trainable_variables)
        )
        excluded = {id(v) for v in candidates if not training_compat.uses_weight_decay(decaying, v)}
    except AttributeError:  # not a Keras BaseOptimizer
        return None
    positions = [i for i, v in enumerate(model.weights) if id(v) in excluded]
    return positions or None


def build_optimizer(
    model: keras.Model,
    built_for: list[int] | None = None,
    where: Any = None,
    *,
    no_decay: list[int] | None = None,
) -> None:
    """Create the optimizer's variables (iteration count, slots) if it has none yet, so they
    can be read or assigned: Keras builds an optimizer lazily on the first training step.
    ``built_for``: the positions ``optimizer_built_for`` recorded (None: the trainable
    variables); ``no_decay``: those ``no_weight_decay`` recorded, left out of weight decay
    before the build (Keras accepts that only before)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    weights = model.weights
    if no_decay is not None:
        chosen = _weights_at(weights, no_decay, where, "left out of weight decay")
        training_compat.innermost_optimizer(optimizer).exclude_from_weight_decay(var_list=chosen)
    if built_for is None:
        optimizer.build(model.trainable_variables)
    else:
        optimizer.build(_weights_at(weights, built_for, where, "the optimizer was built for"))


def _weights_at(weights: list[Any], positions: Any, where: Any, what: str) -> list[Any]:
    valid = isinstance(positions, list) and all(
        isinstance(i, int) and 0 <= i < len(weights) for i in positions
    )
    if not valid or len(set(positions)) != len(positions):
        raise CorruptCheckpointError(
            f"{where}: the stored positions of the variables {what} must be distinct "
            f"positions among the model's {len(weights)} weights; the checkpoint is damaged. "
            f"Load an older one. Received: {str(positions)[:200]}"
        )
    return [weights[i] for i in positions]


def match_trainable(source: keras.Model, target: keras.Model) -> None:
    """Give every layer of ``target`` the ``trainable`` flag of its twin in ``source`` (same
    architecture, layers in the same order). Parents first: Keras' setter also sets every
    sublayer, whose own flag is then set after it.

    Where the two have different layers (variables restored into a model with a layer
    added that holds none), there is nothing to carry if every layer of ``source`` is
    trainable; if one is frozen, ValueError, changing nothing: training it in ``target``
    would silently differ from the run that froze it."""
    mine = keras_compat.sublayers(source, include_self=True)
    theirs = keras_compat.sublayers(target, include_self=True)
    kinds = [[type(layer).__name__ for layer in layers] for layers in (mine, theirs)]
    if kinds[0] != kinds[1]:
        frozen = [layer.name for layer in mine if not layer.trainable]
        if not frozen:
            return
        pairs = zip(*kinds, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(map(len, kinds)))
        raise ValueError(
            f"their layers differ ({len(mine)} vs {len(theirs)} layers, the first difference "
            f"at layer #{first}) and layers {frozen[:5]} were frozen"
        )
    for source_layer, target_layer in zip(mine, theirs, strict=True):
        if target_layer.trainable != source_layer.trainable:
            target_layer.trainable = source_layer.trainable
