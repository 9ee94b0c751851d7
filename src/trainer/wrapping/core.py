"""Wrap chosen layers of a model for training, and strip the wrappers again for export.

Why not ``keras.models.clone_model(clone_function=...)`` (what TF-MOT does)? It only sees the
*top-level* layers of a Sequential/Functional graph: a Conv2D inside a custom ``ResidualBlock``
is invisible to it, and subclassed models are refused outright. (Keras 3 does memoise shared
top-level layers, which Keras 2 / TF-MOT's transformer refused; we keep that property.)

How we do better, per kind of container:

- **Sequential / Functional**: rebuild the graph by re-calling the (possibly replaced) layers
  over the original nodes -- ``clone_model`` with *our* ``clone_function``, memoised by
  ``id`` so a layer used at several call sites maps to ONE replacement (weights stay shared).
- **Custom layers and subclassed models**: their structure is Python attributes, not a graph,
  so we replace the attribute references in place (``self.conv``, ``self.convs[1]``,
  ``self.heads["a"]``), swapping the entry in Keras' ``_layers`` tracking list at the same
  position so the weight order -- which positional weight loading relies on -- is unchanged.
- **Serialization**: a custom layer's own ``get_config`` knows nothing of the wrappers put
  inside it, so reloading it from config would silently drop them. Each top-level custom
  layer whose insides changed therefore goes into the graph inside a :class:`WrapHost`, whose
  config records every replaced attribute path with the replacement's own config, and which
  re-applies them on load. A subclassed root model is hosted in a one-node Functional model.

By default both ``wrap_model`` and ``unwrap_model`` first copy the model (config round trip
plus weights) and transform the copy, so the caller's model is never mutated: unwrapping a
model mid-training for export leaves the training model untouched. ``copy=False`` transforms
in place instead (nested custom layers are then mutated; needed only for unserializable
models). The result is compiled from the same compile config, with a fresh optimizer, if the
input model was compiled: wrap before training starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import keras

from trainer._compat import call_records
from trainer._compat import keras as keras_compat
from trainer.errors import ModelNotReadyError, TrainerError

PACKAGE = "trainer"
Path = tuple[str, ...]  # "attr", "[3]" (sequence index) or "{key}" (dict key) steps

# Keras-internal attributes that hold layers or structures we must not rewire.
_SKIP_ATTRS = keras_compat.LAYER_STATE_ATTRIBUTES | {"optimizer"}


class TrainingWrapper(keras.layers.Wrapper):
    """Base of wrappers that exist only while training; ``unwrap_model`` calls ``unwrap``."""

    def call(self, inputs, *args, **kwargs):
        return self.layer(inputs, *args, **kwargs)

    def unwrap(self) -> keras.layers.Layer:
        """The plain layer to export in place of this wrapper (may bake state into it)."""
        return self.layer


@keras.saving.register_keras_serializable(package=PACKAGE)
class WrapHost(keras.layers.Wrapper):
    """Carries a custom layer whose sublayers were replaced, and re-applies them on load.

    ``replacements`` is a list of ``(paths, new_layer)``: every attribute path (relative to
    ``layer``) where ``new_layer`` now sits. One entry per replacement object, so a sublayer
    reachable from several attributes is still one object after loading.
    """

    def __init__(self, layer, replacements=(), root=False, **kwargs):
        kwargs.setdefault("name", layer.name)
        super().__init__(layer, **kwargs)
        # A plain holder: Keras' tracker would adopt layers found in a list as sublayers.
        self._replacements = _Held([(tuple(map(tuple, ps)), new) for ps, new in replacements])
        self.root = bool(root)

    def build(self, input_shape=None):
        if not self.layer.built:
            self.layer.build(input_shape)

    def call(self, inputs, *args, **kwargs):
        return self.layer(inputs, *args, **kwargs)

    def get_config(self):
        entries = [
            {"paths": [list(p) for p in paths], "layer": keras.saving.serialize_keras_object(new)}
            for paths, new in self._replacements.items
        ]
        return {**super().get_config(), "replacements": entries, "root": self.root}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        des = keras.saving.deserialize_keras_object
        layer = des(config.pop("layer"), custom_objects=custom_objects)
        replacements = []
        for entry in config.pop("replacements", []):
            new = des(entry["layer"], custom_objects=custom_objects)
            paths = [tuple(p) for p in entry["paths"]]
            for path in paths:
                set_path(layer, path, new)
            replacements.append((paths, new))
        return cls(layer, replacements=replacements, **config)


class _Held:
    """Opaque to Keras and TF tracking (they only look into lists, tuples and dicts)."""

    def __init__(self, items):
        self.items = items


# ------------------------------------------------------------------------------ public API
def wrap_model(
    model: keras.Model,
    predicate: Callable[[keras.layers.Layer], bool],
    factory: Callable[[keras.layers.Layer], keras.layers.Layer],
    *,
    copy: bool = True,
) -> keras.Model:
    """A model in which every layer with ``predicate(layer)`` is replaced by ``factory(layer)``.

    Reaches layers at any depth inside custom layers and subclassed models; a layer reached
    from several places gets one replacement. Existing ``TrainingWrapper``s are left alone
    and so are ``WrapHost``s (not descended into), so wrapping twice does not double-wrap.
    """

    def rule(layer):
        if isinstance(layer, TrainingWrapper | WrapHost):
            return layer
        return factory(layer) if predicate(layer) else None

    return _run(model, rule, wrapping=True, copy=copy)


def unwrap_model(model: keras.Model, *, copy: bool = True) -> keras.Model:
    """The model with every ``TrainingWrapper`` replaced by its ``unwrap()`` and hosts removed.

    What is left is made of the user's own layer classes only, so it exports and serves
    without ``trainer`` installed.
    """

    def rule(layer):
        if isinstance(layer, TrainingWrapper):
            return layer.unwrap()
        if isinstance(layer, WrapHost):
            return layer.layer
        return None

    return _run(model, rule, wrapping=False, copy=copy)


def find_layers(model: keras.layers.Layer, cls: type) -> list[keras.layers.Layer]:
    """Every distinct layer of type ``cls`` at any depth (wrappers' insides included)."""
    return [layer for layer in keras_compat.sublayers(model) if isinstance(layer, cls)]


_WRAP_KINDS: dict[str, Callable[..., tuple[keras.Model, list]]] = {}
_WRAPPER_CLASSES: list[type] = []


def register_wrap_kind(
    kind: str, factory: Callable[..., tuple[keras.Model, list]], classes: tuple[type, ...] = ()
) -> None:
    """Make ``wrap.kind: <kind>`` build ``factory(model, wrap_cfg, total_steps=...)``.

    Wrapper kinds register themselves (pruning does, on import), so this core never
    imports a particular wrapper. ``classes`` are the kind's serializable layer classes,
    returned by :func:`custom_objects`.
    """
    _WRAP_KINDS[kind] = factory
    _WRAPPER_CLASSES.extend(c for c in classes if c not in _WRAPPER_CLASSES)


def custom_objects() -> dict[str, type]:
    """The classes a wrapped checkpoint needs; pass as ``custom_objects`` if not registered."""
    classes = [WrapHost, *_WRAPPER_CLASSES]
    return {**{f"{PACKAGE}>{c.__name__}": c for c in classes}, **{c.__name__: c for c in classes}}


def apply_wrap(model: keras.Model, wrap_cfg: Any, *, total_steps: int | None = None):
    """``(model, callbacks)`` for the ``wrap`` config group; ``kind: none`` changes nothing.

    ``total_steps`` (epochs x steps per epoch) resolves schedule ends left as ``null``.
    """
    kind = None if wrap_cfg is None else dict(wrap_cfg).get("kind", "none")
    if kind in (None, "none"):
        return model, []
    if kind not in _WRAP_KINDS:
        raise TrainerError(
            f"Unknown wrap kind {kind!r}. Valid kinds: none, {', '.join(sorted(_WRAP_KINDS))}. "
            f"Pick one with `wrap=<kind>` on the command line. Received: {kind!r}"
        )
    return _WRAP_KINDS[kind](model, wrap_cfg, total_steps=total_steps)


# ---------------------------------------------------------------------------- the rewriter
def _run(model, rule, *, wrapping: bool, copy: bool) -> keras.Model:
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model. Received: {type(model).__name__}")
    work = copy_model(model) if copy else model
    if not wrapping and _is_graph(work):
        hosts = [op for op in work.layers if not isinstance(op, keras.layers.InputLayer)]
        if len(hosts) == 1 and isinstance(hosts[0], WrapHost) and hosts[0].root:
            work = hosts[0].layer  # a subclassed model hosted by wrap_model: give it back
    rewriter = _Rewriter(rule, hosts=wrapping)
    if _is_graph(work):
        result = rewriter.rebuild_graph(work)
    else:
        _, records = rewriter.rewrite(work)
        result = work
        if records and wrapping:
            result = _host_root(work, records)
    if model.compiled:
        result.compile_from_config(model.get_compile_config())
    return result


def _is_graph(layer) -> bool:
    return keras_compat.is_functional(layer) or isinstance(layer, keras.Sequential)


class _Rewriter:
    """Applies ``rule`` everywhere, once per distinct layer object."""

    def __init__(self, rule, *, hosts: bool):
        self.rule = rule
        self.hosts = hosts
        self.memo: dict[int, tuple[keras.layers.Layer, list]] = {}
        self.node_memo: dict[int, keras.layers.Layer] = {}

    def rewrite(self, layer):
        """``(replacement, records)``; records list in-place changes as ``(path, new)``."""
        key = id(layer)
        if key not in self.memo:
            self.memo[key] = (layer, [])  # provisional: guards against reference cycles
            self.memo[key] = self._rewrite(layer)
            new = self.memo[key][0]
            self.memo.setdefault(id(new), (new, []))  # replacements are never rewritten again
        return self.memo[key]

    def _rewrite(self, layer):
        if isinstance(layer, keras.layers.InputLayer):
            return layer, []
        new = self.rule(layer)
        if new is not None:
            if new is layer:
                return new, []
            if self.hosts:
                if layer.built and not new.built and layer.get_build_config():
                    new.build_from_config(layer.get_build_config())  # masks exist right away
                return new, []
            return self.rewrite(new)[0], []  # unwrapping: clean the insides as well
        if _is_graph(layer):
            return self.rebuild_graph(layer), []
        records: list[tuple[Path, keras.layers.Layer]] = []
        for path, child in list(_children(layer)):
            new_child, child_records = self.rewrite(child)
            if new_child is not child:
                set_path(layer, path, new_child)
                records.append((path, new_child))
            records.extend((path + sub, obj) for sub, obj in child_records)
        tracked = keras_compat.tracked_sublayers(layer)
        stale = [c.name for c in tracked if self.rewrite(c)[0] is not c]
        if stale:
            raise TrainerError(
                f"Layer {layer.name!r} ({type(layer).__name__}) tracks sublayers {stale} that "
                f"no attribute, list or dict of it refers to, so they cannot be replaced. "
                f"Assign them to attributes in __init__. Received layer {layer.name!r}"
            )
        return layer, records

    def node(self, layer):
        """Replacement of a graph node: custom layers with changed insides get a host."""
        new, records = self.rewrite(layer)
        if not (records and self.hosts and new is layer):
            return new
        if id(layer) not in self.node_memo:
            self.node_memo[id(layer)] = WrapHost(layer, _group(records))
        return self.node_memo[id(layer)]

    def rebuild_graph(self, model):
        return keras.models.clone_model(model, clone_function=self.node)


def _group(records) -> list[tuple[list[Path], keras.layers.Layer]]:
    by_obj: dict[int, tuple[list[Path], keras.layers.Layer]] = {}
    for path, obj in records:
        by_obj.setdefault(id(obj), ([], obj))[0].append(path)
    return list(by_obj.values())


def _host_root(model: keras.Model, records) -> keras.Model:
    """A subclassed root has no graph to put a host in: make a one-node Functional model."""
    build = model.get_build_config() or {}
    if "input_shape" not in build:
        raise ModelNotReadyError(
            f"Model {model.name!r} must be called on one batch of data (a single input) before "
            f"its nested layers can be wrapped, so its input shape is known. Received build "
            f"config {build!r}"
        )
    shape = tuple(build["input_shape"])
    inputs = keras.Input(batch_shape=(None, *shape[1:]), name="inputs")
    outputs = WrapHost(model, _group(records), root=True)(inputs)
    return keras.Model(inputs, outputs, name=model.name)


# ------------------------------------------------------------------ attribute plumbing
def _children(layer) -> Iterator[tuple[Path, keras.layers.Layer]]:
    """``(path, sublayer)`` for every sublayer held in an attribute, list, tuple or dict."""
    for name, value in list(vars(layer).items()):
        if name in _SKIP_ATTRS or name.startswith("_self_"):
            continue
        yield from _walk_value(value, (name,))


def _walk_value(value, path: Path):
    if isinstance(value, keras.layers.Layer):
        yield path, value
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _walk_value(item, (*path, f"[{index}]"))
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield from _walk_value(item, (*path, f"{{{key}}}"))


def _step_get(obj, step: str):
    if step.startswith("["):
        return obj[int(step[1:-1])]
    if step.startswith("{"):
        return obj[step[1:-1]]
    return getattr(obj, step)


def set_path(root: keras.layers.Layer, path: Path, new: keras.layers.Layer) -> None:
    """Put ``new`` at ``path`` below ``root``, keeping Keras' layer tracking consistent."""
    attr_at = max(i for i, step in enumerate(path) if step[0] not in "[{")
    owner = root
    for step in path[:attr_at]:
        owner = _step_get(owner, step)
    name, indices = path[attr_at], path[attr_at + 1 :]
    old_value = getattr(owner, name)
    old = old_value
    for step in indices:
        old = _step_get(old, step)
    _swap_tracked(owner, old, new)
    setattr(owner, name, _replaced(old_value, indices, new))


def _replaced(value, indices: Path, new):
    if not indices:
        return new
    step, rest = indices[0], indices[1:]
    if step.startswith("["):
        items = list(value)
        items[int(step[1:-1])] = _replaced(items[int(step[1:-1])], rest, new)
        return type(value)(items) if isinstance(value, tuple) else items
    items = dict(value)
    items[step[1:-1]] = _replaced(items[step[1:-1]], rest, new)
    return items


def _swap_tracked(owner, old, new) -> None:
    """Replace ``old`` by ``new`` in ``owner``'s tracked sublayers at the same position."""
    keras_compat.replace_tracked_sublayer(owner, old, new)


# ------------------------------------------------------------------------------ copying
def copy_model(model: keras.Model) -> keras.Model:
    """An independent copy: config round trip, then every weight assigned by position."""
    if not model.built:
        raise ModelNotReadyError(
            f"Model {model.name!r} is not built, so it has no weights to copy. Call it on a "
            f"batch of data first. Received model {model.name!r} ({type(model).__name__})"
        )
    try:
        config = keras.saving.serialize_keras_object(model)
        config.pop("compile_config", None)
        clone = keras.saving.deserialize_keras_object(config, custom_objects=custom_objects())
    except Exception as exc:
        raise ModelNotReadyError(
            f"Model {model.name!r} cannot be copied through its config ({exc}). Make its "
            f"custom classes serializable, or pass copy=False to transform it in place. "
            f"Received model {model.name!r} ({type(model).__name__})"
        ) from exc
    source, target = model.weights, clone.weights
    shapes = [tuple(v.shape) for v in source]
    if shapes != [tuple(v.shape) for v in target]:
        raise ModelNotReadyError(
            f"Model {model.name!r} rebuilt from its config has different weights "
            f"({len(target)} vs {len(source)}): some layer creates state its config does not "
            f"describe. Pass copy=False to transform it in place. Received {len(source)} weights"
        )
    for dst, src in zip(target, source, strict=True):
        dst.assign(src)
    # Built from a config, it has no call record: a subclassed copy's first savedmodel save
    # (``unwrap_model``'s, for export) would try every input form, sparse and ragged too.
    call_records.share_nested(model, clone)
    return clone
