"""Magnitude pruning: the first user of ``trainer.wrapping``.

``PruneLowMagnitude`` keeps a non-trainable 0/1 mask per kernel and runs the wrapped layer
on ``kernel * mask``, so outputs *and* gradients respect the mask (pruned weights get a zero
gradient). ``PruningCallback`` raises the sparsity along a polynomial schedule by zeroing the
smallest-magnitude surviving weights. The schedule's clock is the optimizer's iteration
count, and each wrapper stores the step of its last update in a variable, so a run resumed
from any checkpoint that restores the optimizer continues the schedule exactly.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras
import numpy as np

from trainer._compat import live_objects
from trainer.errors import ConfigError, ConfigMismatchError
from trainer.wrapping.core import (
    PACKAGE,
    TrainingWrapper,
    find_layers,
    register_wrap_kind,
    wrap_model,
)

# Attributes under which Keras layers keep the weight matrices worth pruning.
KERNEL_ATTRS = ("_kernel", "kernel", "depthwise_kernel", "pointwise_kernel")
DEFAULT_LAYER_TYPES = ("Dense", "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2D", "SeparableConv2D")
DEFAULT_FREQUENCY = 10  # steps between mask updates
# What ``wrap=prune`` does for a key its config leaves out; also the defaults of conf/wrap/prune
# (trainer.training.config.PruneConfig takes them from here).
CONFIG_DEFAULTS = {
    "target_sparsity": 0.5,
    "initial_sparsity": 0.0,
    "begin_step": 0,
    "end_step": None,  # the run's last step
    "frequency": DEFAULT_FREQUENCY,
    "power": 3.0,
    "layer_types": ("Dense", "Conv2D"),
    "exclude": (),
}


@dataclasses.dataclass(frozen=True)
class PolynomialSparsity:
    """Sparsity rising from ``initial`` to ``target`` as ``1 - (1 - progress) ** power``.

    Masks change only at ``begin``, every ``frequency`` steps after it, and at ``end``.
    """

    target: float
    initial: float = 0.0
    begin: int = 0
    end: int = 1000
    frequency: int = DEFAULT_FREQUENCY
    power: float = 3.0

    def __post_init__(self):
        # ConfigError (a ValueError too): from train.py, one error line and exit 2.
        if not 0.0 <= self.initial <= self.target < 1.0:
            raise ConfigError(
                f"Pruning needs 0 <= initial_sparsity <= target_sparsity < 1 "
                f"(wrap.initial_sparsity, wrap.target_sparsity). "
                f"Received initial={self.initial}, target={self.target}"
            )
        if not (0 <= self.begin <= self.end and self.frequency >= 1):
            raise ConfigError(
                f"Pruning needs 0 <= begin_step <= end_step and frequency >= 1 (wrap.begin_step, "
                f"wrap.end_step, wrap.frequency). Received "
                f"begin={self.begin}, end={self.end}, frequency={self.frequency}"
            )

    def sparsity_at(self, step: int) -> float:
        if self.end == self.begin:
            progress = 1.0 if step >= self.end else 0.0
        else:
            progress = min(1.0, max(0.0, (step - self.begin) / (self.end - self.begin)))
        return self.target + (self.initial - self.target) * (1.0 - progress) ** self.power

    def last_update(self, step: int) -> int | None:
        """The latest scheduled update step at or before ``step`` (None before ``begin``)."""
        if step < self.begin:
            return None
        if step >= self.end:
            return self.end
        return self.begin + (step - self.begin) // self.frequency * self.frequency


@keras.saving.register_keras_serializable(package=PACKAGE)
class PruneLowMagnitude(TrainingWrapper):
    """Runs ``layer`` with its kernels multiplied by masks that the callback updates."""

    def __init__(
        self,
        layer,
        target_sparsity: float = 0.5,
        initial_sparsity: float = 0.0,
        begin_step: int = 0,
        end_step: int = 1000,
        frequency: int = DEFAULT_FREQUENCY,
        power: float = 3.0,
        **kwargs,
    ):
        kwargs.setdefault("name", f"prune_{layer.name}")
        super().__init__(layer, **kwargs)
        self.schedule = PolynomialSparsity(
            float(target_sparsity), float(initial_sparsity), int(begin_step), int(end_step),
            int(frequency), float(power),
        )  # fmt: skip

    def build(self, input_shape=None):
        super().build(input_shape)
        # Names only: storing the variables here would make the tracker adopt them.
        self._kernel_attrs = [
            a for a in KERNEL_ATTRS if isinstance(vars(self.layer).get(a), keras.Variable)
        ]
        if not self._kernel_attrs:
            raise ValueError(
                f"PruneLowMagnitude wraps layers that keep a kernel ({', '.join(KERNEL_ATTRS)}); "
                f"layer {self.layer.name!r} ({type(self.layer).__name__}) has none. Leave it "
                f"out of `layer_types`. Received layer {self.layer.name!r}"
            )
        self.masks = [
            self.add_weight(
                name=f"{attr.lstrip('_')}_mask",
                shape=tuple(self._kernel(attr).shape),
                initializer="ones",
                dtype=self._kernel(attr).dtype,
                trainable=False,
            )
            for attr in self._kernel_attrs
        ]
        self.pruning_step = self.add_weight(
            name="pruning_step",
            shape=(),
            initializer=keras.initializers.Constant(-1),
            dtype="int64",
            trainable=False,
        )

    def _kernel(self, attr: str) -> keras.Variable:
        return vars(self.layer)[attr]

    def call(self, inputs, *args, **kwargs):
        # The wrapped layer reads its kernel from an attribute; point it at the masked
        # tensor for the duration of the call, so the mask sits inside the gradient path.
        originals = {attr: self._kernel(attr) for attr in self._kernel_attrs}
        try:
            for attr, mask in zip(self._kernel_attrs, self.masks, strict=True):
                live_objects.set_untracked(self.layer, attr, originals[attr] * mask)
            return self.layer(inputs, *args, **kwargs)
        finally:
            for attr, variable in originals.items():
                live_objects.set_untracked(self.layer, attr, variable)

    # ------------------------------------------------------------------ pruning state
    def apply_schedule(self, step: int) -> bool:
        """Catch up with the schedule at optimizer step ``step``; True if masks changed."""
        due = self.schedule.last_update(step)
        if due is None or due <= int(keras.ops.convert_to_numpy(self.pruning_step)):
            return False
        self.prune_to(self.schedule.sparsity_at(due))
        self.pruning_step.assign(due)
        return True

    def prune_to(self, sparsity: float) -> None:
        """Zero the smallest-magnitude weights so exactly ``round(sparsity * size)`` are 0."""
        for attr, mask in zip(self._kernel_attrs, self.masks, strict=True):
            variable = self._kernel(attr)
            weights = np.asarray(keras.ops.convert_to_numpy(variable))
            weights = weights * np.asarray(keras.ops.convert_to_numpy(mask))
            count = round(sparsity * weights.size)
            new_mask = np.ones(weights.size, dtype=weights.dtype)
            # Already-pruned weights are exactly 0 after masking, so they go first (the
            # stable sort keeps ties in index order): masks only ever lose entries.
            new_mask[np.argsort(np.abs(weights).ravel(), kind="stable")[:count]] = 0
            new_mask = new_mask.reshape(weights.shape)
            mask.assign(new_mask)
            variable.assign(weights * new_mask)

    def bake(self) -> None:
        """Write the mask into the stored kernel (masked entries drift under momentum)."""
        for attr, mask in zip(self._kernel_attrs, self.masks, strict=True):
            variable = self._kernel(attr)
            variable.assign(variable * mask)

    def unwrap(self) -> keras.layers.Layer:
        self.bake()
        return self.layer

    def get_config(self):
        s = self.schedule
        return {
            **super().get_config(),
            "target_sparsity": s.target,
            "initial_sparsity": s.initial,
            "begin_step": s.begin,
            "end_step": s.end,
            "frequency": s.frequency,
            "power": s.power,
        }


class PruningCallback(keras.callbacks.Callback):
    """Advances every ``PruneLowMagnitude`` in the model along its schedule.

    Put it before checkpoint callbacks: at each epoch end it bakes masks into the kernels,
    so saved kernels are really sparse. Baking changes no output or gradient.
    """

    def on_train_begin(self, logs=None):
        self._wrappers = find_layers(self.model, PruneLowMagnitude)
        if not self._wrappers:
            warnings.warn(
                f"PruningCallback: model {self.model.name!r} has no PruneLowMagnitude layers; "
                f"nothing will be pruned. Wrap it with trainer.wrapping.apply_wrap first.",
                stacklevel=2,
            )
        self._advance()  # catches up after a resume, and applies a begin_step of 0

    def on_train_batch_end(self, batch, logs=None):
        self._advance()

    def on_epoch_end(self, epoch, logs=None):
        for wrapper in self._wrappers:
            wrapper.bake()

    def on_train_end(self, logs=None):
        self.on_epoch_end(-1)

    def _advance(self):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        for wrapper in self._wrappers:
            wrapper.apply_schedule(step)


def sparsity_report(model: keras.layers.Layer) -> dict[str, Any]:
    """Fraction of exact zeros in every prunable kernel, as the forward pass sees it.

    For a wrapped layer that is ``kernel * mask``; ``stored_sparsity`` is the kernel variable
    alone (equal once the masks are baked, e.g. after training or in the unwrapped model).
    """
    rows, wrapped_inner = [], set()
    for wrapper in find_layers(model, PruneLowMagnitude):
        wrapped_inner.add(id(wrapper.layer))
        for attr, mask in zip(wrapper._kernel_attrs, wrapper.masks, strict=True):
            kernel = np.asarray(keras.ops.convert_to_numpy(wrapper._kernel(attr)))
            effective = kernel * np.asarray(keras.ops.convert_to_numpy(mask))
            rows.append(_row(wrapper._kernel(attr).path, effective, kernel, True))
    for layer in find_layers(model, keras.layers.Layer):
        if id(layer) in wrapped_inner or isinstance(layer, PruneLowMagnitude):
            continue
        for attr in KERNEL_ATTRS:
            variable = vars(layer).get(attr)
            if isinstance(variable, keras.Variable):
                kernel = np.asarray(keras.ops.convert_to_numpy(variable))
                rows.append(_row(variable.path, kernel, kernel, False))
    size = sum(r["size"] for r in rows)
    zeros = sum(r["zeros"] for r in rows)
    return {"layers": rows, "size": size, "zeros": zeros, "sparsity": zeros / max(size, 1)}


def _row(path: str, effective: np.ndarray, stored: np.ndarray, wrapped: bool) -> dict[str, Any]:
    zeros = int(np.count_nonzero(effective == 0))
    return {
        "path": path,
        "size": int(effective.size),
        "zeros": zeros,
        "sparsity": zeros / effective.size,
        "stored_sparsity": float(np.mean(stored == 0)),
        "wrapped": wrapped,
    }


def prunable(layer_types=DEFAULT_LAYER_TYPES, exclude=()):
    """Predicate: layers of the named Keras classes, minus the names in ``exclude``."""
    classes = []
    for name in layer_types:
        cls = getattr(keras.layers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
            raise ConfigMismatchError(
                f"wrap.layer_types names {name!r}, which is not a keras.layers class. Use "
                f"class names such as Dense or Conv2D. Received: {list(layer_types)!r}"
            )
        classes.append(cls)
    excluded = set(exclude)
    return lambda layer: isinstance(layer, tuple(classes)) and layer.name not in excluded


def wrap_from_config(model: keras.Model, cfg: Any, *, total_steps: int | None = None):
    """``apply_wrap`` for ``kind: prune``: ``(wrapped model, [PruningCallback()])``."""
    get = {**CONFIG_DEFAULTS, **{k: v for k, v in dict(cfg).items() if v is not None}}.get
    end_step = get("end_step")
    if end_step is None:
        if total_steps is None:
            raise ConfigMismatchError(
                "wrap.end_step is null (= the run's last step) but the number of training "
                "steps is unknown. Set wrap.end_step explicitly. Received end_step=None"
            )
        end_step = total_steps
    params = {
        "target_sparsity": get("target_sparsity"),
        "initial_sparsity": get("initial_sparsity"),
        "begin_step": get("begin_step"),
        "end_step": end_step,
        "frequency": get("frequency"),
        "power": get("power"),
    }
    existing = find_layers(model, PruneLowMagnitude)
    if existing:  # a model loaded from a wrapped checkpoint: keep its wrappers and schedule
        wanted = PolynomialSparsity(
            float(params["target_sparsity"]), float(params["initial_sparsity"]),
            int(params["begin_step"]), int(end_step), int(params["frequency"]),
            float(params["power"]),
        )  # fmt: skip
        stored = {w.schedule for w in existing}
        if stored != {wanted}:
            raise ConfigMismatchError(
                f"Model {model.name!r} is already pruned with {sorted(map(str, stored))} but "
                f"the config asks for {wanted}; resuming would not continue the same "
                f"schedule. Use the checkpoint's wrap settings. Received: {wanted}"
            )
        return model, [PruningCallback()]
    predicate = prunable(get("layer_types"), get("exclude") or ())
    wrapped = wrap_model(model, predicate, lambda layer: PruneLowMagnitude(layer, **params))
    if not find_layers(wrapped, PruneLowMagnitude):
        warnings.warn(
            f"wrap=prune matched no layer of model {model.name!r}: nothing will be pruned.",
            stacklevel=2,
        )
    return wrapped, [PruningCallback()]


register_wrap_kind("prune", wrap_from_config, classes=(PruneLowMagnitude,))
