"""A run's TensorBoard log: hparams, serving graph, checkpoint cards, and links back to it.

Every checkpoint and export records a *link* in its metadata (log dir, run name, step,
event file) so that a tool holding only the artifact can open the curves that produced
it; ``links.resolve_link`` follows it and checks the event file really holds that step, and
that no later session's restart hides it from TensorBoard.

``RunBoard`` owns one event file (a unique filename suffix makes it findable), written next
to whatever else logs into the same directory: TensorBoard merges the files of one
directory into one run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.scalar import summary_v2 as scalar_summary
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorflow.core.protobuf import saved_model_pb2

from trainer.errors import TensorBoardLinkError
from trainer.model_state.serving import serving_function
from trainer.storage.integrity import total_size
from trainer.tensorboard.hparams import replace_earlier_hparams
from trainer.tensorboard.links import LINK_KEY
from trainer.tensorboard.summary_writes import SummaryWrites, open_writer

HPARAM_TYPES = (bool, int, float, str)


def to_container(cfg: Any) -> Any:
    """Plain dicts/lists from an OmegaConf config (resolved), or ``cfg`` as it is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return cfg
    if isinstance(cfg, DictConfig | ListConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def flatten_config(cfg: Any, *, sep: str = ".") -> dict[str, bool | int | float | str]:
    """``{"optimizer.learning_rate": 0.001, ...}``: HParams accept only scalars, so lists
    become JSON text and ``None`` becomes ``"null"``."""
    flat: dict[str, bool | int | float | str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, child in value.items():
                walk(f"{prefix}{sep}{key}" if prefix else str(key), child)
        elif isinstance(value, HPARAM_TYPES):
            flat[prefix] = value
        elif value is None:
            flat[prefix] = "null"
        else:
            flat[prefix] = json.dumps(value, sort_keys=True, default=str)

    walk("", to_container(cfg))
    return flat


def config_hash(cfg: Any, *, ignore: tuple[str, ...] = ("run_dir",)) -> str:
    """Short SHA-256 of the resolved config; top-level keys in ``ignore`` (where the run
    writes, not what it computes) are left out so two identical runs hash alike."""
    data = to_container(cfg)
    if isinstance(data, Mapping):
        data = {k: v for k, v in data.items() if k not in ignore}
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def saved_model_graph_def(directory: str | os.PathLike) -> Any:
    """The GraphDef of a SavedModel's (first) MetaGraph, with its function library."""
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((Path(directory) / "saved_model.pb").read_bytes())
    return proto.meta_graphs[0].graph_def


def card_tag(kind: str, name: str) -> str:
    """Text tag of an artifact's card: ``checkpoints/epoch-001``, ``exports/3``."""
    return f"{kind}s/{name}"


class RunBoard:
    """The TensorBoard side of one run: its own event file in ``log_dir``.

    ``run_dir`` is the Hydra run directory (default: the log dir's parent); ``run_name``
    is what TensorBoard shows when started on the run directory's parent (for a Hydra
    multirun: ``<job>/tb``). ``on_write_error`` is the run's
    ``checkpoint.policy.on_save_error``: a failed write raises ``TensorBoardWriteError``
    (``raise``) or is logged once per kind and skipped (``continue``; see
    ``trainer.tensorboard.summary_writes``).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        run_dir: str | os.PathLike | None = None,
        run_name: str | None = None,
        config_hash: str | None = None,
        on_write_error: str = "raise",
        log_url: str | None = None,
    ):
        self.log_dir = Path(log_dir).absolute()
        # Where the log is copied on object storage (``trainer.training.store_sync``): the
        # links of checkpoints and exports name it, for a reader on another machine.
        self.log_url = log_url
        self.run_dir = Path(run_dir).absolute() if run_dir else self.log_dir.parent
        self.run_name = run_name or os.path.relpath(self.log_dir, self.run_dir.parent)
        self.config_hash = config_hash
        self.writes = SummaryWrites(self.log_dir, on_write_error)
        with self.writes.writing("creating the log directory"):
            self.log_dir.mkdir(parents=True, exist_ok=True)
        suffix = f".{uuid.uuid4().hex[:12]}.v2"
        writer = open_writer(self.writes, self.log_dir, filename_suffix=suffix)
        self.writer = writer or tf.summary.create_noop_writer()
        self.flush()
        files = sorted(self.log_dir.glob(f"*{suffix}"))
        self.event_file: Path | None = files[0] if len(files) == 1 else None
        if self.event_file is None and self.writes.on_error == "raise":
            raise TensorBoardLinkError(
                f"Could not find the event file just created in {self.log_dir} (suffix "
                f"{suffix!r}); is the directory writable? Received files: {files}"
            )

    # ------------------------------------------------------------------ writing
    def write_hparams(
        self,
        flat_config: Mapping[str, Any],
        final_metrics: Mapping[str, float],
        *,
        step: int = 0,
    ) -> None:
        """``write_session_hparams`` plus ``write_final_metrics`` at ``step``."""
        self.write_session_hparams(flat_config)
        self.write_final_metrics(final_metrics, step=step)

    def write_session_hparams(self, flat_config: Mapping[str, Any]) -> None:
        """This session's config for the HParams tab; earlier sessions' hparams in the
        directory become text (``trainer.tensorboard.hparams``), so the tab shows this one.

        No experiment summary is written: with one per run, TensorBoard would pick one
        arbitrarily; without, it infers hparams and metrics from every run's session.
        """
        values = flatten_config(dict(flat_config))
        with self.writes.writing("writing hparams"), self.writer.as_default(step=0):
            hp.hparams(values, start_time_secs=int(time.time()))
            self.writer.flush()
        self.replace_earlier_hparams()

    def replace_earlier_hparams(self) -> int:
        """Keep only the newest hparams session in the log directory (also repairs a crash
        between writing one and replacing the older); returns how many it held."""
        with self.writes.writing("replacing earlier sessions' hparams"):
            return replace_earlier_hparams(self.log_dir)
        return 0

    def write_final_metrics(self, final_metrics: Mapping[str, float], *, step: int) -> None:
        """``final/<metric>`` scalars at ``step``: the HParams tab's metric columns."""
        with self.writes.writing("writing final metrics"), self.writer.as_default(step=step):
            for name, value in final_metrics.items():
                tf.summary.scalar(f"final/{name}", float(value))
            self.writer.flush()

    def write_graph(self, source: Any, *, step: int = 0) -> None:
        """Put a serving graph in the Graphs tab. ``source`` is a Keras model (its serving
        function, as ``export_serving`` exports it with ``format="keras"``), a traced
        ``tf.function`` or concrete function, or a SavedModel directory (its own graph,
        read from ``saved_model.pb``: exactly what a model server loads)."""
        if isinstance(source, str | os.PathLike):
            graph_def = saved_model_graph_def(source)
        else:
            fn = source
            if not hasattr(fn, "graph"):
                if not hasattr(fn, "get_concrete_function"):
                    fn = serving_function(fn)
                fn = fn.get_concrete_function()
            graph_def = fn.graph.as_graph_def()
        with self.writes.writing("writing the graph"), self.writer.as_default(step=step):
            tf.summary.graph(graph_def)
            self.writer.flush()

    def checkpoint_card(
        self,
        step: int,
        path: str | os.PathLike,
        run_dir: str | os.PathLike | None = None,
        backend: str | None = None,
        format_version: int | None = None,
        size_bytes: int | None = None,
        save_seconds: float | None = None,
        metrics: Mapping[str, float] | None = None,
        config_hash: str | None = None,
        *,
        blocking_seconds: float | None = None,
        kind: str = "checkpoint",
        tag: str | None = None,
    ) -> str:
        """Markdown card at ``step`` plus ``<kind>/save_seconds`` and ``<kind>/size_bytes``
        scalars (and ``<kind>/blocking_seconds``: how long the save held the training loop,
        which for an async save is far less than the write); returns the card's tag
        (default ``card_tag(kind, path.name)``). Flushed, so a link to ``step`` resolves now."""
        path = Path(path)
        base = Path(run_dir).absolute() if run_dir else self.run_dir
        size_bytes = total_size(path) if size_bytes is None and path.exists() else size_bytes
        tag = tag or card_tag(kind, path.name)
        text = card_markdown(
            kind=kind,
            path=_relative(path, base),
            step=step,
            backend=backend,
            format_version=format_version,
            size_bytes=size_bytes,
            save_seconds=save_seconds,
            metrics=metrics or {},
            config_hash=config_hash or self.config_hash,
        )
        # One event holding the card and its scalars, written by one op: the same values
        # four summary ops would write, a third of their CPU in the async writer thread.
        summary = summary_pb2.Summary()
        summary.value.extend(text_summary.text_pb(tag, text).value)
        for name, value in (
            ("save_seconds", save_seconds),
            ("blocking_seconds", blocking_seconds),
            ("size_bytes", size_bytes),
        ):
            if value is not None:
                summary.value.extend(scalar_summary.scalar_pb(f"{kind}/{name}", value).value)
        with self.writes.writing(f"{kind} cards"), self.writer.as_default(step=step):
            tf.summary.experimental.write_raw_pb(summary.SerializeToString())
            self.writer.flush()
        return tag

    def checkpoint_deleted(self, step: int, name: str, *, kind: str = "checkpoint") -> None:
        """Mark the card of a checkpoint that retention deleted: its tag gets one more
        entry at ``step`` saying so, which the Text tab shows first, so that the card no
        longer reads as a checkpoint that can still be loaded."""
        text = (
            f"**{kind}** `{name}`: **deleted** by retention at step {step} (the "
            f"`checkpoint` policy keeps the others); the card at its own step shows what it held."
        )
        with self.writes.writing(f"{kind} cards"), self.writer.as_default(step=step):
            tf.summary.experimental.write_raw_pb(
                text_summary.text_pb(card_tag(kind, name), text).SerializeToString()
            )
            self.writer.flush()

    def artifact_published(self, step: int, tag: str, url: str, *, kind: str = "export") -> None:
        """One more entry on the card ``tag`` at ``step``: where the artifact was published
        on object storage (the card itself names its local copy)."""
        text = f"**{kind}** published on object storage: `{url}`"
        with self.writes.writing(f"{kind} cards"), self.writer.as_default(step=step):
            tf.summary.experimental.write_raw_pb(
                text_summary.text_pb(tag, text).SerializeToString()
            )
            self.writer.flush()

    def link(
        self, step: int, artifact: str | os.PathLike | None = None, *, tag: str | None = None
    ) -> dict[str, Any]:
        """What goes under ``metadata["tensorboard"]``. ``artifact`` is the final path of the
        checkpoint/export; the run dir is then stored relative to its parent directory too,
        so the link survives moving the whole run directory."""
        link = {
            "log_dir": _relative(self.log_dir, self.run_dir),
            "run_name": self.run_name,
            "step": int(step),
            "run_dir_absolute": str(self.run_dir),
        }
        if self.event_file is not None:  # None: it could not be created (on_error=continue)
            link["event_file"] = self.event_file.name
        if artifact is not None:
            link["run_dir"] = os.path.relpath(self.run_dir, Path(artifact).absolute().parent)
        if tag is not None:
            link["tag"] = tag
        if self.config_hash:
            link["config_hash"] = self.config_hash
        if self.log_url:
            link["log_url"] = self.log_url
        return link

    def save_checkpoint(
        self,
        backend: Any,
        model: Any,
        path: str | os.PathLike,
        *,
        state: Any,
        metadata: Mapping[str, Any] | None = None,
    ) -> Path:
        """Save through ``backend`` with the link in the metadata, then write the card."""
        final = backend.checkpoint_path(path)
        step = int(state.global_step)
        meta = dict(metadata or {})
        meta[LINK_KEY] = self.link(step, final, tag=card_tag("checkpoint", final.name))
        start = time.perf_counter()
        saved = backend.save(model, final, state=state, metadata=meta)
        seconds = time.perf_counter() - start
        self.checkpoint_card(
            step,
            saved,
            backend=backend.name,
            format_version=backend.format_version,
            size_bytes=total_size(saved),
            save_seconds=seconds,
            metrics=state.metrics,
        )
        return saved

    def flush(self) -> None:
        with self.writes.writing("flushing the event file"):
            self.writer.flush()

    def close(self) -> None:
        with self.writes.writing("closing the event file"):
            self.writer.close()
        self.writes.report()

    def __enter__(self) -> RunBoard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def card_markdown(
    *,
    kind: str,
    path: str,
    step: int,
    backend: str | None,
    format_version: int | None,
    size_bytes: int | None,
    save_seconds: float | None,
    metrics: Mapping[str, float],
    config_hash: str | None,
) -> str:
    """The text card: a two-column markdown table (TensorBoard renders tables)."""
    rows = [
        ("path", f"`{path}`"),
        ("step", str(step)),
        ("backend", f"{backend} (format version {format_version})" if backend else "?"),
        ("size", _human_bytes(size_bytes) if size_bytes is not None else "?"),
        ("save time", f"{save_seconds:.3f} s" if save_seconds is not None else "?"),
        ("config hash", f"`{config_hash}`" if config_hash else "?"),
    ]
    rows += [(f"metric `{k}`", f"{float(v):.6g}") for k, v in sorted(metrics.items())]
    lines = [f"**{kind}** `{Path(path).name}`", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size:,} B" if unit == "B" else f"{value:.1f} {unit} ({size:,} B)"
        value /= 1024
    return f"{size} B"  # pragma: no cover


def _relative(path: Path, base: Path) -> str:
    return os.path.relpath(Path(path).absolute(), base)


def tensorboard_command(run_dir: str | os.PathLike) -> str:
    """The command that opens a run in TensorBoard: ``--logdir`` the run directory's
    parent, where the run is called ``<run>/tb``, as ``inspect`` and the checkpoint links
    name it (``RunBoard.run_name``), beside its sibling runs (a multirun's jobs).

    Never the log directory itself: TensorBoard then calls the run "." and its HParams
    plugin looks the session's metric values up in a run "./." that does not exist, so the
    HParams tab showed every session without metrics."""
    return f"tensorboard --logdir {Path(run_dir).absolute().parent}"
