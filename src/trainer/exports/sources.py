"""Exports of a saved checkpoint or of a run that just finished training.

``trainer.exports.exporter`` writes and seals a version from a model in memory; this module finds
that model and what goes with it: a checkpoint of any backend (its state, config and
TensorBoard link; warmup examples from its run's data set), or the end of a run driven
by the ``export`` config group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer import data as data_sets
from trainer.errors import ExportError, TensorBoardWriteError, TrainerError
from trainer.exports.exporter import (
    DEFAULT_KEEP,
    check_format_and_keep,
    export_serving,
    export_tag,
)
from trainer.exports.warmup import check_warmup_limit
from trainer.storage.locations import is_remote, local_path
from trainer.tensorboard.board import LINK_KEY, RunBoard


def _local_copy(checkpoint_path: str | os.PathLike) -> tuple[Path, str]:
    """The checkpoint as a local path and what the export records as its source: a URL on
    object storage is downloaded into the local cache (checked against its commit marker)
    and recorded as the URL of the checkpoint ``latest`` named; a local path, resolved."""
    from trainer.save_backends.loading import fetch_remote

    if not is_remote(checkpoint_path):
        return Path(checkpoint_path), str(Path(checkpoint_path).resolve())
    local = fetch_remote(os.fspath(checkpoint_path))
    directory = os.fspath(checkpoint_path).rstrip("/").rpartition("/")[0]
    return local, f"{directory}/{local.name}"


def export_from_checkpoint(
    checkpoint_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    keep: int = DEFAULT_KEEP,
    warmup: Any = None,
    format: str = "auto",
    tensorboard: str | os.PathLike | None = None,
    with_optimizer: bool = False,
    safe_mode: bool = True,
    log_url: str | None = None,
    publish: Callable[[Path], str | None] | None = None,
) -> Path:
    """Export the model of a checkpoint of any backend into ``out_dir/<version>/``.

    ``warmup``: examples, or a count N of validation examples taken from the data set of
    the checkpoint's run config. The export carries the checkpoint's state, config and
    TensorBoard link (``checkpoint_tensorboard``). The checkpoint's run is only read, never
    written (it may be read-only, or another user's). ``tensorboard``: a log directory
    for the export's card and graph at the checkpoint's step, which the export then links
    to; None (the default) writes no TensorBoard log. ``with_optimizer``: see
    ``export_serving`` (the checkpoint is then loaded compiled, its optimizer restored).
    ``safe_mode=False``: load a checkpoint holding a Python lambda (a ``Lambda`` layer),
    running its code; only for a checkpoint of a source you trust. ``log_url``: where the
    ``tensorboard`` log is copied on object storage (``trainer export --tensorboard URL``),
    recorded in the export's link. ``publish``: called with the complete version, returns
    the URL it was published at on object storage (or None), which the export's card then
    names (``trainer export CHECKPOINT URL``).
    """
    from trainer.save_backends import load_checkpoint

    if tensorboard is not None:  # a URL must never become a local folder named "s3:"
        tensorboard = local_path(tensorboard, "TensorBoard log directory")
    counted = isinstance(warmup, int) and not isinstance(warmup, bool)  # N examples
    if counted:
        warmup_count(warmup, "warmup")  # before the checkpoint is loaded
    local, source = _local_copy(checkpoint_path)
    checkpoint = load_checkpoint(local, compile=bool(with_optimizer), safe_mode=bool(safe_mode))
    meta = checkpoint.metadata
    if counted:
        warmup = (
            validation_examples(meta.get("config"), warmup, checkpoint_path) if warmup else None
        )
    extra = _export_metadata(checkpoint, source)
    link = extra.get("checkpoint_tensorboard") or {}
    board = None
    if tensorboard is not None:  # opened first: an unwritable log fails before any export
        board = _open_board(Path(tensorboard), link, log_url)
    try:
        path = export_serving(
            checkpoint.model,
            out_dir,
            keep=keep,
            warmup=warmup,
            metadata=extra,
            board=board,
            step=checkpoint.state.global_step if board is not None else None,
            format=format,
            with_optimizer=with_optimizer,
        )
        url = publish(path) if publish is not None else None
        if url is not None and board is not None:  # the card names where it is served from
            board.artifact_published(checkpoint.state.global_step, export_tag(board, path), url)
        return path
    finally:
        if board is not None:
            board.close()


def _export_metadata(checkpoint: Any, source: str) -> dict[str, Any]:
    """What an export of ``checkpoint`` records of it: its source, state, config and
    TensorBoard link (``checkpoint_tensorboard``)."""
    meta = checkpoint.metadata
    extra: dict[str, Any] = {
        "source": {
            # Resolved: `latest` (a pointer the next save moves) must not be recorded.
            "checkpoint": source,
            "backend": meta.get("backend"),
            "format_version": meta.get("format_version"),
        },
        "state": checkpoint.state.to_dict(),
    }
    if "config" in meta:
        extra["config"] = meta["config"]
    link = meta.get(LINK_KEY)
    if isinstance(link, Mapping):
        extra["checkpoint_tensorboard"] = dict(link)
    return extra


def _open_board(log_dir: Path, link: Mapping[str, Any], log_url: str | None = None) -> RunBoard:
    """The RunBoard for an export's card in ``log_dir``, or an ``ExportError`` saying why
    that directory cannot take one."""
    try:
        return RunBoard(log_dir, config_hash=link.get("config_hash"), log_url=log_url)
    except (OSError, tf.errors.OpError, TrainerError) as error:
        # A TensorBoardWriteError speaks of training (stopped, resume, on_save_error):
        # nothing of that applies to an export, so its cause is what was received.
        if isinstance(error, TensorBoardWriteError) and error.__cause__ is not None:
            error = error.__cause__
        raise ExportError(
            f"Cannot write the export's TensorBoard card into {log_dir}: the directory "
            f"cannot be created or written. Name a writable directory, or leave out the "
            f"TensorBoard option to export without a card. Received: {type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]}"
        ) from None


def check_export_options(
    options: Mapping[str, Any] | None, checkpoint_directory: str | None = None
) -> None:
    """The ``export`` config group's values, checked when a run starts rather than when
    its export is written after training: an ``ExportError`` naming the key.
    ``checkpoint_directory``: the run's ``checkpoint.directory``, which exports must stay
    out of (a resume takes the newest entry there: an export, which holds no training
    state, made the run impossible to resume)."""
    options = dict(options or {})
    if not options.get("enabled", True):
        return
    warmup_count(options.get("warmup_examples") or 0, "export.warmup_examples")
    keep = options.get("keep", DEFAULT_KEEP)
    export_format = options.get("format", "auto")
    check_format_and_keep(export_format, keep, prefix="export.")
    if options.get("with_optimizer") and export_format == "keras":
        raise ExportError(
            "export.format=keras is inference-only and cannot carry the optimizer; set "
            "export.format=savedmodel (or auto), or export.with_optimizer=false. "
            "Received: export.format=keras, export.with_optimizer=true"
        )
    directory = options.get("directory", "export")
    if checkpoint_directory is not None and _overlap(str(directory), str(checkpoint_directory)):
        raise ExportError(
            f"export.directory {directory!r} is (or is inside, or holds) the checkpoint "
            f"directory {checkpoint_directory!r}: a resume would take an export for the "
            f"newest checkpoint. Choose another export.directory (default 'export'). "
            f"Received: export.directory={directory!r}"
        )


def _overlap(first: str, second: str) -> bool:
    a, b = (os.path.normpath(path) for path in (first, second))
    if os.curdir in (a, b):  # the run directory itself holds the other
        return True
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def warmup_count(value: Any, what: str) -> int:
    """A number of warmup examples: a whole number, at least 0 (used as a slice end, -1
    took every example but one), at most what TF Serving loads (checked before any
    checkpoint is loaded or run trained, not when the export is written)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ExportError(
            f"{what} must be a whole number of validation examples, at least 0 (0: no "
            f"warmup requests). Received: {value!r}"
        )
    check_warmup_limit(value, what)
    return value


# The data loaders that warmup may call from a checkpoint's run config: trainer's own. A
# checkpoint is data, and its config could name any importable callable as `_target_`
# (``numpy.savetxt`` wrote a file of the probe's choosing through ``hydra.utils.instantiate``).
_DATA_LOADERS = {
    f"trainer.data.{loader.__name__}": loader
    for loader in (data_sets.load_digits, data_sets.make_synthetic, data_sets.load_npz)
}


def validation_examples(config: Mapping[str, Any] | None, count: int, where: Any) -> np.ndarray:
    """The first ``count`` validation inputs (training inputs if there are none) of the data
    set a run config describes, for warmup requests. Only trainer's own loaders are called,
    with plain arguments: nothing the checkpoint names is imported or instantiated."""
    if not isinstance(config, Mapping) or "data" not in config:
        raise ExportError(
            f"{where} records no run config with a `data` section, so no validation examples "
            f"can be built for warmup. Export without warmup. Received config keys: "
            f"{sorted(config) if isinstance(config, Mapping) else config!r}"
        )
    spec = dict(config["data"]) if isinstance(config["data"], Mapping) else {}
    loader = _DATA_LOADERS.get(spec.pop("_target_", None))
    plain = all(
        isinstance(key, str) and not key.startswith("_") and isinstance(value, _PLAIN)
        for key, value in spec.items()
    )
    if loader is None or not plain:
        raise ExportError(
            f"Warmup examples are built only by trainer's own data loaders "
            f"({sorted(_DATA_LOADERS)}) with plain arguments; the run config of {where} "
            f"describes another data set, and a checkpoint must not choose code to run. Pass "
            f"the examples to export_from_checkpoint(warmup=array) or export without warmup. "
            f"Received data config: {str(dict(config['data']))[:300]}"
        )
    try:
        data = loader(**spec)
    except (TypeError, TrainerError) as error:
        raise ExportError(
            f"The data set of {where}'s run config cannot be built for warmup examples: "
            f"{error}. Export without warmup. Received data config: {str(spec)[:300]}"
        ) from None
    inputs = data.x_val if len(data.x_val) else data.x_train
    return np.asarray(inputs[:count])


_PLAIN = (str, int, float, bool, type(None))


def export_for_run(
    model: keras.Model,
    run_dir: str | os.PathLike,
    export_cfg: Mapping[str, Any] | None,
    *,
    board: RunBoard | None,
    state: Any,
    validation_x: Any = None,
    config: Mapping[str, Any] | None = None,
) -> Path | None:
    """End-of-training export driven by the ``export`` config group (``conf/export``):
    ``run_dir/<directory>/<version>/`` with warmup from ``validation_x``, the run's state
    and config in the metadata, and a card at the current step. ``None`` if disabled."""
    options = dict(export_cfg or {})
    if not options.get("enabled", True):
        return None
    count = warmup_count(options.get("warmup_examples") or 0, "export.warmup_examples")
    warmup = None
    if count and validation_x is not None and len(validation_x):
        warmup = np.asarray(validation_x[:count])
    metadata: dict[str, Any] = {"state": state.to_dict(), "source": {"checkpoint": None}}
    if config is not None:
        metadata["config"] = dict(config)
    return export_serving(
        model,
        Path(run_dir) / str(options.get("directory") or "export"),
        keep=int(options.get("keep") or DEFAULT_KEEP),
        warmup=warmup,
        metadata=metadata,
        board=board,
        step=int(state.global_step),
        format=str(options.get("format") or "auto"),
        with_optimizer=bool(options.get("with_optimizer", False)),
    )
