"""``savedmodel``: a real TensorFlow SavedModel that also revives as a trainable Keras model.

Servable by anyone (``tf.saved_model.load``, ``TFSMLayer``, ``saved_model_cli``), and
revivable by trainer: per-layer records in ``assets.extra/trainer_metadata.json`` say how
to rebuild each layer from config, or from its traced functions when its class is gone.
Layout and record fields: ``trainer.save_backends.savedmodel.layout`` and
docs/explanation/savedmodel-format.md.

Saving is traced once per model structure: later saves of the same model only write the
variables checkpoint and the metadata next to the cached graph (``trace_cache``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import keras
import tensorflow as tf

from trainer._compat import keras as keras_compat
from trainer._compat import live_objects
from trainer._compat.initializers import DeferredInitializers
from trainer.errors import CorruptCheckpointError, MissingClassError
from trainer.model_state import dtype_policy, kit, layer_protocol
from trainer.model_state.kit import checkpoint_state
from trainer.save_backends import legacy
from trainer.save_backends.base import LoadedCheckpoint, SaveBackend
from trainer.save_backends.savedmodel import layout
from trainer.save_backends.savedmodel.features import layer_state, training_logic
from trainer.save_backends.savedmodel.load import partial_load, stored_variables
from trainer.save_backends.savedmodel.load.revival import NeedsTracedFunctions, Reviver
from trainer.save_backends.savedmodel.load.stored_variables import DeferredValues
from trainer.save_backends.savedmodel.records import check_json
from trainer.save_backends.savedmodel.save import endpoints, trace_cache
from trainer.state import TrainingState
from trainer.storage import integrity, limits
from trainer.storage.integrity import MANIFEST_FILE
from trainer.storage.locations import local_path

log = logging.getLogger(__name__)
# Selective imports tried (each adding the layers found to need functions) before the
# whole SavedModel is imported.
_PARTIAL_ATTEMPTS = 3


class SavedModelBackend(SaveBackend):
    """Directory checkpoint in TensorFlow SavedModel format, revivable layer by layer."""

    name: ClassVar[str] = "savedmodel"
    # 2: assets.extra/trainer_layer_state.h5 (layers' own state, restored through their
    # load_own_variables / load_assets). Version 1 loads when no layer keeps such state.
    format_version: ClassVar[int] = 2
    is_directory: ClassVar[bool] = True
    suffix: ClassVar[str] = ""
    async_by_default: ClassVar[bool] = True
    # The variables' values are read after the layers are rebuilt (StoredVariables.value).
    read_late: ClassVar[tuple[str, ...]] = ("variables/variables.data-*",)
    # The integrity manifest sits with our metadata in assets.extra/, which TF and TF
    # Serving ignore by convention, so the directory stays a clean SavedModel.
    manifest_file: ClassVar[str] = f"{layout.METADATA_DIR}/{MANIFEST_FILE}"

    def __init__(self, reuse_traces: bool = True):
        # reuse_traces=False forces a full trace + tf.saved_model.save on every save.
        self.reuse_traces = reuse_traces

    @classmethod
    def can_load(cls, path: Path) -> bool:
        return layout.has_metadata(Path(path)) or legacy.is_legacy(Path(path))

    @classmethod
    def read_metadata(cls, path: Path) -> dict[str, Any]:
        if legacy.is_legacy(Path(path)):
            legacy.refuse_metadata(Path(path))
        return layout.read_metadata(Path(path))

    # ---------------------------------------------------------------------- save
    def check_rebuildable(self, model: keras.Model) -> None:
        """Nothing to refuse: layers revived from traced functions are saved with their
        traces again, and a layer that cannot rebuild from its config is revived from its
        traces at load."""

    def build_metadata(
        self, model: keras.Model, state: TrainingState, extra: dict[str, Any]
    ) -> dict[str, Any]:
        meta = super().build_metadata(model, state, extra)
        meta["compile_config"] = kit.compile_config(model)
        check_json(meta["compile_config"], f"compile config of model {model.name!r}")
        check_json(extra, "caller metadata")
        return meta

    def _write(
        self, model: keras.Model, tmp: Path, state: TrainingState, metadata: dict[str, Any]
    ) -> dict[str, Any]:
        with keras_compat.call_losses_kept(model):  # tracing must not empty model.losses
            traced, full, known = trace_cache.write_saved_model(model, tmp, reuse=self.reuse_traces)
        if traced.encoded is None:
            traced.encoded = layout.encode(
                {
                    "format": layout.FORMAT,
                    "layers": traced.layers,
                    "variables": traced.variables,
                    "optimizer_variables": traced.optimizer_variables,
                    "signature": traced.signature,
                    "structure_fingerprint": traced.fingerprint,
                }
            )
        metadata = {**metadata, "full_save": full}
        layer_state.write(model, tmp)  # before the metadata, which marks completeness
        text = layout.write_metadata(tmp, metadata, encoded={"savedmodel": traced.encoded})
        known[f"{layout.METADATA_DIR}/{layout.METADATA_FILE}"] = integrity.known_digest(text)
        return known

    def prepare_repeat_saves(self, model: keras.Model, scratch: Path) -> bool:
        """After a first save of ``model``: trace its repeat-save variables write now (into
        ``scratch``, a throwaway directory), which would otherwise run op by op on every
        save. For callers that can pay a trace ahead of the saves, off the training thread:
        async checkpointing's rehearsal. Returns whether the write is traced."""
        entry = trace_cache.cached(model)
        if entry is None or entry.writer is None:
            return False
        if not entry.writer.traced:
            Path(scratch).mkdir(parents=True, exist_ok=True)
            try:
                entry.writer.trace(str(Path(scratch) / "variables"))
            except (TypeError, ValueError, tf.errors.OpError) as err:  # eager writes remain
                log.info("Repeat-save write not traced: %s", err)
                return False
        return True

    # ---------------------------------------------------------------------- load
    def load(
        self,
        path: str | os.PathLike,
        *,
        custom_objects: dict[str, Any] | None = None,
        compile: bool = True,
        safe_mode: bool = True,
        verify: bool = True,
    ) -> LoadedCheckpoint:
        """Revive the model; ``safe_mode=False`` allows configs carrying Python code
        (``Lambda``) to be rebuilt from that code instead of from traced functions."""
        path = local_path(path, "checkpoint path")
        if legacy.is_legacy(path):  # tf.keras' own model.save(dir): import it
            return legacy.load_legacy(path, custom_objects=custom_objects, compile=compile)
        if layout.is_saved_model(path) and not layout.has_metadata(path):
            layout.read_metadata(path)  # raises the "plain SavedModel" error
        return super().load(
            path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode, verify=verify
        )

    def _read(
        self, path: Path, *, custom_objects: dict[str, Any], compile: bool, safe_mode: bool = True
    ) -> LoadedCheckpoint:
        limits.check_text_size(layout.metadata_path(path).stat().st_size, "metadata", path)
        meta = layout.read_metadata(path)
        self.check_format_version(meta, path)
        saved = meta["savedmodel"]
        for record in saved["layers"]:  # untrusted: bound nesting and sizes before building
            limits.check_structure(record, "layer record", path, dimensions=True)
            config = record.get("keras_config") if isinstance(record, dict) else None
            if isinstance(config, dict):
                # Keras compiles a model rebuilt from a config holding "compile_config";
                # compiling is ours to do below, and only if asked (compile=False).
                config.pop("compile_config", None)
        options = {
            "custom_objects": custom_objects,
            "safe_mode": safe_mode,
            "where": str(path),
            "directory": path,
        }
        metadata = dict(meta)
        # Revive and compile under the model's own policy (``policies``): a mixed_float16
        # model is compiled with a LossScaleOptimizer only if it is built under it.
        with dtype_policy.global_policy(
            dtype_policy.stored_policy(_root_policy(saved["layers"][0]))
        ):
            model, reviver, values = _revive(path, saved, options)
            endpoints.keep_input_names(model, saved.get("signature"))
            metadata["revived_from"] = dict(reviver.how)
            metadata["traced_functions_loaded"] = reviver.with_functions
            metadata["traced_functions_imported"] = reviver.functions_imported
            if meta["format_version"] >= 2:
                if layer_state.state_path(path).is_file():
                    values.assign_model()  # a layer's own restore may read its variables
                layer_state.restore(model, reviver.layers, saved["layers"], path)
            else:
                layer_protocol.refuse_older_format(model, path, assets_only=False)
            root = saved["layers"][0]
            name = root.get("name")
            missing = reviver.how.get(name) == "traced" or name in reviver.plain_graphs
            training_logic.guard(model, root, missing, bool(compile), path)
            if compile and meta.get("compile_config"):
                dropped = _compile(
                    model, meta["compile_config"], custom_objects, reviver.safe_mode, path
                )
                if dropped:
                    metadata["dropped_metrics"] = dropped
            # The first use of the variables data file (see _revive): after the compile,
            # which builds the optimizer from the variables' shapes alone.
            values.assign_model()
            if compile and meta.get("compile_config"):
                kit.restore_optimizer_arrays(model, values.optimizer_arrays(), str(path))
        state = checkpoint_state(meta.get("state"), path)
        return LoadedCheckpoint(model=model, state=state, metadata=metadata, path=path)


def _revive(
    path: Path, saved: dict[str, Any], options: dict[str, Any]
) -> tuple[keras.Model, Reviver, stored_variables.DeferredValues]:
    """The model (its variables bound, not yet given their stored values), its reviver
    and those values (``DeferredValues``: the caller compiles and builds the optimizer
    first, so that a load whose variables file is still arriving from a store waits for
    it as late as possible).

    Classes first: when every layer is rebuilt from its class, the values are read from
    the variables checkpoint and the traced functions are never imported (the cost of a
    ``.keras`` load: configs plus one file of weights). When layers need their traced
    functions, only those are imported (``partial_load``); what the pruning does not
    handle goes through ``tf.saved_model.load`` of the whole SavedModel instead."""
    proto = stored_variables.check_saved_model(path, len(saved["layers"]))
    stored = stored_variables.StoredVariables(path)
    reviver = Reviver(stored.model, None, saved["layers"], saved["variables"], **options)
    try:
        model = _revive_root(reviver, path)
        return model, reviver, DeferredValues(reviver, stored.value, stored.optimizer_arrays)
    except NeedsTracedFunctions as why:
        log.info("Loading the traced functions of %s: %s", path, why)
        needed = {why.layer_id}
    needed |= partial_load.predict_traced(
        saved["layers"], options["custom_objects"] or {}, options["safe_mode"]
    )
    revived = _revive_partially(path, saved, options, proto, stored, needed)
    if revived is not None:
        return revived
    return _revive_fully(path, saved, options, len(proto.meta_graphs[0].graph_def.library.function))


def _revive_partially(
    path: Path,
    saved: dict[str, Any],
    options: dict[str, Any],
    proto: Any,
    stored: stored_variables.StoredVariables,
    needed: set[int],
) -> tuple[keras.Model, Reviver, DeferredValues] | None:
    """Revive with the functions of the ``needed`` layers only; ``None`` when that route
    does not apply or fails in any way (the full import then decides, including which
    error a broken checkpoint gets). A layer found to need its functions on the way is
    added and the load tried again, a bounded number of times."""
    for _ in range(_PARTIAL_ATTEMPTS):
        try:
            prepared = partial_load.plan(proto, needed)
            if prepared is None:
                log.info("%s: the traced functions cannot be imported selectively", path)
                return None
            loaded = partial_load.load(path, prepared, len(saved["layers"]), stored)
            reviver = Reviver(
                loaded.storage, loaded.nodes, saved["layers"], saved["variables"], **options
            )
            model = _revive_root(reviver, path, stored.value)
        except NeedsTracedFunctions as why:
            needed = needed | {why.layer_id}
            continue
        except Exception as err:  # anything unexpected: the full import decides
            log.info("%s: selective import failed (%s: %s)", path, type(err).__name__, err)
            return None
        reviver.functions_imported = loaded.functions_imported
        # functions in use
        live_objects.set_marker(model, live_objects.LOADED_SAVEDMODEL, loaded.keep_alive)
        return model, reviver, DeferredValues(reviver, None, stored.optimizer_arrays)
    return None


def _revive_fully(
    path: Path, saved: dict[str, Any], options: dict[str, Any], library: int
) -> tuple[keras.Model, Reviver, DeferredValues]:
    """Revive from ``tf.saved_model.load`` of the whole SavedModel."""
    integrity.await_digests()  # TensorFlow reads the variables' values
    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as err:
        raise CorruptCheckpointError(
            f"{path} cannot be loaded as a SavedModel ({type(err).__name__}: {err}). "
            f"The directory is damaged; load an older checkpoint. Received: {str(path)!r}"
        ) from err
    reviver = Reviver(
        loaded.model_variables, loaded.layer_nodes, saved["layers"], saved["variables"], **options
    )
    model = _revive_root(reviver, path)
    reviver.functions_imported = library
    # Keep the loaded object alive as long as the model: its functions are in use.
    live_objects.set_marker(model, live_objects.LOADED_SAVEDMODEL, loaded)
    return (
        model,
        reviver,
        DeferredValues(reviver, None, lambda: [v.numpy() for v in loaded.optimizer_variables]),
    )


def _revive_root(
    reviver: Reviver, path: Path, read: Callable[[Any], Any] | None = None
) -> keras.Model:
    """The revived model with its values: stored ones assigned (``read``), loaded ones
    shared. Variables are created without running their initializers, since the values
    replace them; any variable left without a value is initialized as Keras would."""
    with DeferredInitializers() as deferred:
        model = reviver.revive(0)
    if not isinstance(model, keras.Model):
        raise CorruptCheckpointError(f"{path}: the root did not revive as a keras.Model")
    if read is not None:
        reviver.assign_stored(read)
    deferred.initialize_rest(reviver.keras_vars.values())
    return model


def _root_policy(record: Any) -> Any:
    """The root layer record's stored policy (untrusted: ``dtype_policy.stored_policy``)."""
    return record.get("dtype_policy") if isinstance(record, dict) else None


def _compile(
    model: keras.Model,
    config: dict[str, Any],
    custom_objects: dict[str, Any],
    safe_mode: bool,
    where: Path,
) -> list[Any]:
    """Compile as saved, under ``safe_mode``. Metrics whose class is missing are dropped,
    logged and returned (the caller reports them in the metadata), because a metric's state
    cannot be revived from a traced function; every other metric is kept. A missing loss
    or optimizer class is an error."""
    options = {"custom_objects": custom_objects, "safe_mode": safe_mode, "where": where}
    try:
        kit.compile_model(model, config, **options)
        return []
    except MissingClassError as first:
        config = dict(config)
        dropped: list[Any] = []

        def missing(entry: Any) -> bool:
            return kit.names_a_missing_class(entry, custom_objects, safe_mode)

        for key in ("metrics", "weighted_metrics"):
            if config.get(key):
                config[key] = _without(config[key], missing, dropped)
        if not dropped:
            raise
        try:
            kit.compile_model(model, config, **options)
        except MissingClassError:
            raise first from None
        log.warning(
            "%s: compiled without the metrics whose class is missing here (a metric's state "
            "cannot be revived from a traced function; pass their classes in custom_objects "
            "to keep them): %s",
            where,
            ", ".join(_metric_name(entry) for entry in dropped),
        )
        return dropped


def _without(value: Any, missing: Callable[[Any], bool], dropped: list[Any]) -> Any:
    """``value`` (a compile config's metrics: one entry, a list, a list per output or a
    dict by output name) without the entries ``missing`` picks, which go to ``dropped``.
    Lists per output keep their places, emptied if need be."""
    if not _is_container(value):
        return None if _dropped(value, missing, dropped) else value
    items = value.items() if isinstance(value, dict) else enumerate(value)
    kept = [
        (key, _without(entry, missing, dropped) if _is_container(entry) else entry)
        for key, entry in items
        if _is_container(entry) or not _dropped(entry, missing, dropped)
    ]
    return dict(kept) if isinstance(value, dict) else [entry for _, entry in kept]


def _dropped(entry: Any, missing: Callable[[Any], bool], dropped: list[Any]) -> bool:
    if missing(entry):
        dropped.append(entry)
        return True
    return False


def _is_container(value: Any) -> bool:
    """A list, or a dict by output name (not a serialized object)."""
    return isinstance(value, list) or (isinstance(value, dict) and not _is_object(value))


def _is_object(entry: Any) -> bool:
    return isinstance(entry, dict) and "class_name" in entry


def _metric_name(entry: Any) -> str:
    if _is_object(entry):
        return str(entry.get("registered_name") or entry.get("class_name"))
    return str(entry)
