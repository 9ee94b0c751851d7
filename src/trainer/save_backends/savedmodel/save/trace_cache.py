"""Trace once, save many.

The first save of a model traces every layer and runs ``tf.saved_model.save``; the bytes
of ``saved_model.pb`` and of the assets are kept in memory next to the traced root module.
A later save of the same, structurally unchanged model writes those bytes back plus a
fresh variables checkpoint: in one op over the keys and object graph the first save wrote
(``variables_writer``; the first save writes its variables while it traces,
``variables_first``), else from ``tf.train.Checkpoint(root)``. With the root passed
positionally, that checkpoint restores by the SavedModel's own paths (same children, same
keys ``model_variables/0/.ATTRIBUTES/VARIABLE_VALUE`` ...), which the tests verify by
loading a fast-saved directory with ``tf.saved_model.load`` and comparing values.

The cache is keyed weakly by the model and the traced functions only hold weak references
to layers, so it never keeps a model alive.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from trainer._compat import tensorflow as tf_compat
from trainer.save_backends import early_files
from trainer.save_backends.savedmodel import layout
from trainer.save_backends.savedmodel.bundle import saver_def, variables_writer
from trainer.save_backends.savedmodel.features import python_gradients
from trainer.save_backends.savedmodel.save import (
    object_graph,
    served_inputs,
    structure,
    variable_plan,
    variables_first,
)
from trainer.save_backends.savedmodel.save.options import save_options
from trainer.storage import integrity

log = logging.getLogger(__name__)
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COPIED = ("saved_model.pb",)


@dataclasses.dataclass
class Entry:
    traced: object_graph.TracedModel
    files: dict[str, bytes]  # relative path -> content, everything but variables/
    writer: variables_writer.VariablesWriter | None = None  # None: tf.train.Checkpoint
    # Relative path -> (size, SHA-256) of ``files``, for the manifest (``integrity``).
    digests: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)


def clear() -> None:
    _CACHE.clear()


def cached(model: keras.Model) -> Entry | None:
    return _CACHE.get(model)


def write_saved_model(
    model: keras.Model, directory: Path, *, reuse: bool = True
) -> tuple[object_graph.TracedModel, bool, dict[str, Any]]:
    """Write the SavedModel of ``model`` into ``directory``; returns (traced, full_save,
    the size and digest of the files written from memory, for the manifest)."""
    directory = Path(directory)
    entry = _CACHE.get(model) if reuse else None
    if entry is not None and entry.traced.fingerprint == structure.fingerprint(model):
        known = _fast_write(entry, directory)
        write_vocabularies(model, directory)
        return entry.traced, False, known
    plan = variable_plan.plan_variables(model)
    early = variables_first.start(plan, directory)  # written while the functions trace
    try:
        # Failed tries leave nothing behind, and no call the save makes is recorded as the
        # model's (``tf.saved_model.save`` may trace again).
        with served_inputs.leaving_no_trace_state():
            traced = object_graph.trace_model(model, plan)
            writer = _save_with_our_saver(traced, directory, plan, early)
    except BaseException:
        if early is not None:
            early.discard()  # nothing may still write into a directory being cleaned up
        raise
    kept = early is not None and early.kept and early.known
    pending = early.known if kept else _digest_variables(directory)
    announce_variables(directory, pending)
    write_vocabularies(model, directory)
    files = {}
    for path in directory.rglob("*"):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and not relative.startswith("variables/"):
            files[relative] = path.read_bytes()
    _annotate_node_ids(traced, files["saved_model.pb"])
    digests = {relative: integrity.known_digest(content) for relative, content in files.items()}
    _CACHE[model] = Entry(traced=traced, files=files, writer=writer, digests=digests)
    return traced, True, {**digests, **pending}  # digests: read back from disk just above


def _digest_variables(directory: Path) -> dict[str, integrity.PendingDigest]:
    """The variables' data files (most of a large model's bytes), hashed in a thread from
    now on, while the rest of the save is written (``integrity.PendingDigest``)."""
    return {
        f"variables/{path.name}": integrity.PendingDigest(path)
        for path in (directory / "variables").glob("variables.data-*")
    }


def announce_variables(directory: Path, known: dict[str, Any]) -> None:
    """Tell a listening caller (``early_files``) that the variables' data files are
    complete: written before the index, the fingerprint, the metadata, the manifest and
    the fsync, they hold most of a large model's bytes, which an upload can start on while
    the rest is written. Only files whose digest is known already (hashed while written):
    one still being hashed (``PendingDigest``) is left to the upload after the save."""
    for relative, found in sorted(known.items()):
        if relative.startswith("variables/variables.data-") and isinstance(found, tuple):
            early_files.finished(directory, relative, *found)


def _save_with_our_saver(
    traced: object_graph.TracedModel,
    directory: Path,
    plan: variable_plan.VariablePlan,
    early: variables_first.VariablesWrite | None,
) -> variables_writer.VariablesWriter | None:
    """``tf.saved_model.save`` without TensorFlow's SaverDef, then ours (``saver_def``);
    where ours cannot be written (a checkpoint entry that is not a plain variable), it
    saves again with TensorFlow's. ``early``: the variables, being written already
    (``variables_first``, which starts only for plain variables). Returns the one-op
    variables writer, if there is one."""
    if not plan.plain_variables_only():  # known now: no first save to throw away
        return _save_with_tensorflows_saver(traced, directory)
    with tf_compat.exported_variable_handles() as handles:
        if early is not None:
            early.join()
        signatures = {"serving_default": traced.serving}
        skipped = early is not None and _with_gradients(
            traced,
            lambda options: tf_compat.save_without_checkpoint(
                traced.root, str(directory), signatures, options
            ),
            tf_saver=False,
        )
        if not skipped:  # writes the checkpoint (again)
            _with_gradients(traced, lambda options: _save(traced, directory, options), False)
    writer = variables_writer.from_first_save(traced.root, _variables_prefix(directory))
    try:
        ours = writer is not None and saver_def.add_saver(directory, writer, handles)
    except Exception as err:  # TensorFlow's internals moved: its own SaverDef is right
        log.warning("SaverDef left to TensorFlow: %s: %s", type(err).__name__, err)
        ours = False
    if ours:
        tf_compat.write_fingerprint(str(directory))  # it hashes saved_model.pb
        if skipped:
            early.kept = True  # its files are the checkpoint: what it knows of them holds
        return writer
    log.info("SaverDef left to TensorFlow: the checkpoint is not plain variables only")
    return _save_with_tensorflows_saver(traced, directory)


def _save_with_tensorflows_saver(
    traced: object_graph.TracedModel, directory: Path
) -> variables_writer.VariablesWriter | None:
    _with_gradients(traced, lambda options: _save(traced, directory, options), True)
    return variables_writer.from_first_save(traced.root, _variables_prefix(directory))


def _with_gradients(traced: object_graph.TracedModel, save: Any, tf_saver: bool) -> Any:
    """``save(options)``, with the gradient functions of the traces' ``tf.custom_gradient``
    calls if any layer's traces use one: a layer revived from them then trains. Where
    TensorFlow cannot save a gradient function (it captures what a SavedModel cannot
    hold), the save goes on without them, and those layers refuse training when revived
    (their records say so: ``python_gradients.set_saved``). Returns what ``save`` does."""
    if not python_gradients.marked(traced.layers):
        return save(save_options(tf_saver=tf_saver, gradients=False))
    try:
        result = save(save_options(tf_saver=tf_saver, gradients=True))
    except ValueError as err:
        if not python_gradients.unsaveable(err):  # not a gradient TensorFlow refused
            raise
        log.warning("Custom gradients left out of the SavedModel: %s", err)
        python_gradients.set_saved(traced.layers, False)
        return save(save_options(tf_saver=tf_saver, gradients=False))
    python_gradients.set_saved(traced.layers, True)
    return result


def _save(traced: object_graph.TracedModel, directory: Path, options: Any) -> None:
    signatures = {"serving_default": traced.serving}
    tf.saved_model.save(traced.root, str(directory), signatures=signatures, options=options)


def _variables_prefix(directory: Path) -> str:
    return str(directory / "variables" / "variables")


def write_vocabularies(model: keras.Model, directory: Path) -> None:
    """Lookup layers' vocabularies as JSON lists under ``assets/keras/<layer id>/``, so a
    layer rebuilt from config does not depend on the vocabulary file it was made from.
    JSON, not Keras's one token per line: that text gave an ``IntegerLookup``'s tokens back
    as strings (its OOV token ``-1`` became a word, every index shifted) and split tokens
    holding line breaks (format version 1 wrote ``vocabulary.txt``; loads still read it)."""
    for index, layer in enumerate(object_graph.tracing.all_layers(model)):
        if hasattr(layer, "get_vocabulary") and hasattr(layer, "set_vocabulary"):
            target = layout.vocabulary_folder(directory, index)
            target.mkdir(parents=True, exist_ok=True)
            words = layer.get_vocabulary(include_special_tokens=True)
            words = [w.item() if hasattr(w, "item") else w for w in words]  # NumPy scalars
            (target / layout.VOCAB_FILE).write_text(json.dumps(words, ensure_ascii=False))


def _fast_write(entry: Entry, directory: Path) -> dict[str, Any]:
    """Write the remembered files and a new variables checkpoint; returns the size and
    digest of what was written from memory (the remembered files, the fingerprint)."""
    known = {}
    for parent in sorted({os.path.dirname(relative) for relative in entry.files} - {""}):
        (directory / parent).mkdir(parents=True, exist_ok=True)  # once each, not per file
    for relative, content in entry.files.items():
        if relative == "fingerprint.pb":
            continue
        # Written, never hard-linked from the checkpoint before: kept checkpoints share no
        # file, so damage to one (a bad block, a truncating tool) leaves the others whole.
        (directory / relative).write_bytes(content)
        if not relative.startswith(f"{layout.VOCAB_DIR}/"):  # rewritten next, maybe changed
            known[relative] = entry.digests[relative]
    (directory / "variables").mkdir(exist_ok=True)
    prefix = _variables_prefix(directory)
    index_hash = None
    if entry.writer is not None:
        written = entry.writer.write(prefix)
        index_hash = written.index_hash
        known.update(written.known or _digest_variables(directory))
        announce_variables(directory, written.known)
    else:
        tf.train.Checkpoint(entry.traced.root).write(prefix)
        known.update(_digest_variables(directory))
    try:  # the fingerprint hashes the new checkpoint; optional for loaders
        previous = entry.files.get("fingerprint.pb")
        if previous is None:
            tf_compat.write_fingerprint(str(directory))
        else:  # the same saved_model.pb: only the checkpoint's hash is new
            fingerprint = tf_compat.fingerprint_for_new_variables(
                str(directory), previous, index_hash
            )
            (directory / "fingerprint.pb").write_bytes(fingerprint)
            known["fingerprint.pb"] = integrity.known_digest(fingerprint)
    except (OSError, ValueError, TypeError, tf.errors.OpError) as err:  # pragma: no cover
        log.info("SavedModel fingerprint not written: %s", err)  # optional for loaders
    return known


def _annotate_node_ids(traced: object_graph.TracedModel, pb: bytes) -> None:
    """Record the object-graph node id of every variable (``model_variables/i``)."""
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString(pb)
    nodes = proto.meta_graphs[0].object_graph_def.nodes
    children = {c.local_name: c.node_id for c in nodes[0].children}
    list_id = children.get("model_variables")
    if list_id is None:
        return
    ids = {c.local_name: c.node_id for c in nodes[list_id].children}
    for record in traced.variables:
        record["node_id"] = ids.get(str(record["index"]))
