"""Serving exports: ``export/<version>/`` SavedModels that a model server can watch.

A version is written under a hidden temporary name in the export root and renamed to its
integer name only when complete (TF Serving and friends only consider integer-named
directories), so a server never loads half a model. Versions increase; older ones are
removed (renamed away first, then deleted) beyond ``keep``.

Each version holds ``assets.extra/trainer_export.json`` (what was exported, from where,
its signatures and its TensorBoard link), optionally TF Serving warmup requests in
``assets.extra/tf_serving_warmup_requests``, and, written last before the rename,
``assets.extra/trainer_manifest.json``: size and SHA-256 of every other file of the
version, so ``python -m trainer verify`` checks an export whole.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from trainer.errors import ExportError, NotACheckpointError, SaveError
from trainer.exports.warmup import EXPORT_FILE, EXPORT_MANIFEST, EXTRA_DIR, write_warmup
from trainer.model_state import kit
from trainer.model_state.readiness import check_model_ready
from trainer.model_state.serving import SERVING_KEY, input_signature, saved_model_signatures
from trainer.model_state.serving import serving_function as make_serving_function
from trainer.storage import integrity
from trainer.storage.atomic import (
    clean_stale_temporaries,
    fsync_tree,
    remove_atomically,
    remove_path,
    temporary_sibling,
    write_error,
)
from trainer.storage.integrity import total_size
from trainer.storage.locations import local_path
from trainer.tensorboard.board import LINK_KEY, RunBoard, card_tag
from trainer.version import __version__

log = logging.getLogger(__name__)

FORMAT = "trainer-export"
FORMAT_VERSION = 1  # of the export layout and its metadata
FORMATS = ("auto", "keras", "savedmodel")
DEFAULT_KEEP = 5  # newest versions kept; also the default of export.keep (trainer.training.config)
_VERSION = re.compile(r"^[0-9]+$")


def versions(export_root: str | os.PathLike) -> list[int]:
    """Complete versions under ``export_root``, ascending (temporaries are never listed)."""
    root = local_path(export_root, "export directory")
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if _VERSION.match(p.name) and p.is_dir())


def export_metadata_path(version_dir: str | os.PathLike) -> Path:
    return Path(version_dir) / EXTRA_DIR / EXPORT_FILE


def is_export(path: str | os.PathLike) -> bool:
    return export_metadata_path(path).is_file()


def read_export_metadata(version_dir: str | os.PathLike) -> dict[str, Any]:
    path = export_metadata_path(version_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise NotACheckpointError(
            f"{version_dir} is not a trainer export: {path} cannot be read ({error}). Pass a "
            f"version directory such as export/3. Received: {str(version_dir)!r}"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise NotACheckpointError(
            f"{path} is not trainer export metadata (format {FORMAT!r}). "
            f"Received format: {data.get('format') if isinstance(data, dict) else data!r}"
        )
    return data


def export_serving(
    model: keras.Model,
    export_root: str | os.PathLike,
    *,
    keep: int = DEFAULT_KEEP,
    warmup: Any = None,
    metadata: Mapping[str, Any] | None = None,
    board: RunBoard | None = None,
    step: int | None = None,
    format: str = "auto",
    graph: bool = True,
    with_optimizer: bool = False,
) -> Path:
    """Export ``model`` as ``export_root/<next version>/`` and return that path.

    ``warmup``: a few input examples (array, or dict of arrays keyed by signature input)
    turned into TF Serving warmup requests, one request per example. ``board`` + ``step``:
    record the TensorBoard link in the metadata and write the export's card at ``step``
    (and, with ``graph``, the exported graph to the Graphs tab).
    ``format``: ``keras`` (a lean inference-only SavedModel by ``keras.export``),
    ``savedmodel`` (trainer's backend: servable *and* revivable), or
    ``auto`` (``savedmodel`` when its module imports, else ``keras``). ``with_optimizer``:
    keep the compile state, optimizer slots and per-layer training traces in a
    ``savedmodel`` export (off by default: a server never trains, and the slots double or
    triple the size); without it the export revives as an uncompiled inference model, and
    a layer revived without its class refuses ``training=True``.
    """
    _check_export_arguments(model, format, keep, with_optimizer)
    if warmup is not None:
        _check_warmup_inputs(model)
    root = local_path(export_root, "export directory").absolute()
    _check_export_root(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(root)  # left by killed exports or prunes
    start = time.perf_counter()
    version = max(versions(root), default=0) + 1
    tmp = temporary_sibling(root / str(version))
    meta = dict(metadata or {}, with_optimizer=bool(with_optimizer))
    try:
        used = _write_saved_model(model, tmp, format, meta)
        meta.update(_export_metadata(model, tmp, used, warmup))
        final = _publish(tmp, root, version, board, step, meta)
    except (OSError, tf.errors.OpError) as error:  # disk full, permissions, I/O
        remove_path(tmp)
        raise write_error(root / str(version), error) from error
    except BaseException:
        remove_path(tmp)
        raise
    seconds = time.perf_counter() - start
    if board is not None and step is not None:
        _record_on_board(board, step, final, used, meta, seconds, graph=graph)
    prune(root, keep)
    log.info("Exported %s as version %s in %.2fs", model.name, final, seconds)
    return final


def _check_export_arguments(
    model: keras.Model, format: str, keep: int, with_optimizer: bool
) -> None:
    """Refuse bad arguments before anything is written."""
    check_model_ready(model)
    revived = _revived_from_traces(model)
    if revived and format == "keras":
        raise ExportError(
            f"Model {model.name!r} was revived from its traced functions (its class was "
            f"missing at load): Keras knows no input signature for it, which format=keras "
            f"needs. Export with format=savedmodel (or auto), or load it with its class. "
            f"Received format='keras'"
        )
    if not revived:  # a revived model's traces give its signature
        input_signature(model)
    check_format_and_keep(format, keep)
    if with_optimizer and format == "keras":
        raise ExportError(
            "A format=keras export is inference-only and cannot carry the optimizer; export "
            "with format=savedmodel (or auto), or without the optimizer. "
            "Received format='keras', with_optimizer=True"
        )


def check_format_and_keep(format: Any, keep: Any, *, prefix: str = "") -> None:
    """The export format and the number of versions kept, each named as the caller's user
    knows it (``prefix="export."``: a run's config, checked when the run starts)."""
    if format not in FORMATS:
        raise ExportError(
            f"Unknown export {prefix}format {format!r}; valid: {FORMATS}. Received {format!r}"
        )
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ExportError(
            f"{prefix}keep must be at least 1 (the new version). Received {prefix}keep={keep!r}"
        )


def _check_export_root(root: Path) -> None:
    """Refuse a root that is a file, or that is (or lies inside) a checkpoint or an export:
    a version written there would change a sealed directory (its manifest no longer
    matches; ``trainer verify`` fails), and pruning would delete inside it."""
    if root.exists() and not root.is_dir():
        raise ExportError(
            f"The export directory {root} is a file; exports are version directories under "
            f"a directory. Pass a directory (for example <run>/export). Received: {str(root)!r}"
        )
    for directory in (root, *root.parents):
        export = is_export(directory)
        if export or any((directory / at).is_file() for at in integrity.KNOWN_LOCATIONS):
            kind = "an export" if export else "a checkpoint"
            raise ExportError(
                f"The export directory {root} is inside {kind} ({directory}): a version "
                f"written there would change that sealed directory, which would then fail "
                f"verification. Export to a directory of its own (for example <run>/export). "
                f"Received: {str(root)!r}"
            )


def _revived_from_traces(model: keras.Model) -> bool:
    """A model the savedmodel backend revived from its traced functions (its class was
    missing): Keras knows no input signature for it, its traces do (``format="keras"``,
    which needs Keras's, cannot export it)."""
    try:
        from trainer.save_backends.savedmodel.save.endpoints import revived_call_args
    except ImportError:  # the savedmodel backend cannot be imported here
        return False
    return revived_call_args(model) is not None


def _check_warmup_inputs(model: keras.Model) -> None:
    """Warmup requests are cut one example per request from dense arrays; the signature
    of a model taking ragged or sparse tensors takes their components (values, row splits,
    indices), which cannot be cut per example that way."""
    composite = [
        t.name
        for t in getattr(model, "inputs", None) or []
        if getattr(t, "ragged", False) or getattr(t, "sparse", False)
    ]
    if composite:
        raise ExportError(
            f"Model {model.name!r} takes ragged or sparse inputs {composite}: its "
            f"serving_default signature takes their components, from which warmup requests "
            f"cannot be cut one example each. Export it without warmup examples. "
            f"Received warmup for inputs {composite}"
        )


def _export_metadata(model: keras.Model, tmp: Path, used: str, warmup: Any) -> dict[str, Any]:
    """What the export's metadata file says of it; writes the warmup requests first, as
    their count is part of it."""
    signatures = saved_model_signatures(tmp)
    warmup_count = 0
    if warmup is not None:
        warmup_count = write_warmup(tmp, warmup, signatures[SERVING_KEY]["inputs"])
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "exported_with": used,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "trainer_version": __version__,
        "keras_version": keras.__version__,
        "tensorflow_version": tf.__version__,
        "model_name": model.name,
        "signatures": signatures,
        "warmup_requests": warmup_count,
    }


def _record_on_board(
    board: RunBoard,
    step: int,
    final: Path,
    used: str,
    meta: dict[str, Any],
    seconds: float,
    *,
    graph: bool,
) -> None:
    """The export's card (and, with ``graph``, its graph) in the run's TensorBoard."""
    if graph:
        board.write_graph(final, step=step)
    state = meta.get("state") or {}
    board.checkpoint_card(
        step,
        final,
        tag=export_tag(board, final),
        backend=used,
        format_version=FORMAT_VERSION,
        size_bytes=total_size(final),
        save_seconds=seconds,
        metrics=state.get("metrics") or {},
        kind="export",
    )


def _write_saved_model(model: keras.Model, tmp: Path, format: str, meta: dict[str, Any]) -> str:
    if format in ("auto", "savedmodel"):
        with_optimizer = bool(meta.get("with_optimizer"))
        backend = _savedmodel_backend(required=format == "savedmodel" or with_optimizer)
        if backend is not None:
            from trainer.state import TrainingState

            state = TrainingState.from_dict(meta.get("state") or {})
            # Straight into our temporary: backend.save would take a temporary of its own
            # next to it (a doubled hidden name) and seal before our files are added.
            with contextlib.nullcontext() if with_optimizer else kit.inference_only():
                backend.write_into(model, tmp, state=state, metadata={"export": True})
            return "savedmodel"
    serve = make_serving_function(model)
    serve.get_concrete_function()  # ExportArchive takes a tf.function only once traced
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve)
    tmp.mkdir()
    archive.write_out(str(tmp), verbose=False)
    return "keras"


def _savedmodel_backend(*, required: bool):
    try:
        from trainer.save_backends import get_backend

        return get_backend("savedmodel")
    except ImportError as error:
        if required:
            raise ExportError(
                f"The savedmodel backend cannot be imported ({error}); export with "
                f"format='keras' instead. Received format='savedmodel'"
            ) from error
        return None


def _publish(
    tmp: Path, root: Path, version: int, board: RunBoard | None, step: int | None, meta: dict
) -> Path:
    """Write the metadata, seal, flush, and rename to the first free version number."""
    for attempt in range(100):
        final = root / str(version + attempt)
        if board is not None and step is not None:
            meta[LINK_KEY] = board.link(step, final, tag=export_tag(board, final))
        meta["version"] = version + attempt
        path = export_metadata_path(tmp)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, separators=(",", ":"), sort_keys=True, default=str))
        seal_export(tmp, meta["exported_with"])
        fsync_tree(tmp)
        if final.exists():  # another exporter took this number meanwhile
            continue
        try:
            os.rename(tmp, final)
        except OSError:
            if final.exists():
                continue
            raise
        return final
    raise SaveError(f"No free version number under {root} after 100 tries. Received {version}")


def seal_export(directory: Path, exported_with: str) -> dict[str, Any]:
    """The manifest of every file of the export, after all of them (the backend's metadata,
    the warmup requests, ``trainer_export.json``) are written: what ``verify`` checks."""
    info: dict[str, Any] = {"kind": "export", "exported_with": exported_with}
    if exported_with == "savedmodel":  # also a checkpoint its backend loads
        backend = _savedmodel_backend(required=True)
        info.update(backend=backend.name, format_version=backend.format_version)
    return integrity.write_manifest(directory, EXPORT_MANIFEST, **info)


def export_tag(board: RunBoard, final: Path) -> str:
    """The card tag of the export at ``final``: its path (relative to the board's run when
    inside it), so exports to different roots never share a tag in one log."""
    final = Path(final).absolute()
    name = os.path.relpath(final, board.run_dir)
    if name.startswith(".."):
        name = final.as_posix().lstrip("/")
    return card_tag("export", name)


def prune(export_root: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest versions; each is renamed to a hidden temporary
    before deletion, so a server never sees a half-deleted version under a real name. Only
    trainer's exports count and go: a numbered directory of anything else is never touched
    (it still takes its number: the next version is above it)."""
    root = local_path(export_root, "export directory")
    removed = []
    exports = [version for version in versions(root) if is_export(root / str(version))]
    for version in exports[:-keep]:
        path = root / str(version)
        if remove_atomically(path) is not None:  # None: removed concurrently
            removed.append(path)
    return removed
