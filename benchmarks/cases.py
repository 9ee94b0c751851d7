"""Save/load measurements in this (Keras 3) process: our backends, Keras 3's own formats and
the disk's write-and-fsync floor, all on the same model and the same directory."""

from __future__ import annotations

import collections
import gc
import os
import re
import time
from pathlib import Path

import keras
import tensorflow as tf

from benchmarks import exports, models
from benchmarks.specs import Size
from benchmarks.timing import Result, disk_bytes, not_available, remove, timed

FLOOR_CHUNK = 8 << 20
# A fresh model per first-save repeat retraces its train step: expected, not worth a warning.
tf.get_logger().setLevel("ERROR")


def savedmodel_backend():
    """Our SavedModel backend, or the reason it cannot be used in this checkout."""
    try:
        from trainer.save_backends import get_backend

        return get_backend("savedmodel"), ""
    except Exception as err:  # not landed yet, or broken: reported, never estimated
        return None, f"not available ({type(err).__name__}: {err})"[:200]


def measure_size(size: Size, repeats: int, workdir: Path, log=print) -> list[Result]:
    """Every in-process row for one model size."""
    root = Path(workdir) / size.name
    root.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []

    def run(result: Result) -> None:
        results.append(result)
        shown = f"{result.median:.3f}s" if result.median is not None else result.status
        log(f"  [{size.name}] {result.label}: {shown} {result.note}".rstrip())

    model = models.build(size)
    log(f"  [{size.name}] {model.count_params():,} parameters, {len(model.layers)} layers")
    for result in savedmodel_rows(size, model, repeats, root, log):
        run(result)
    for result in backend_rows(size, model, repeats, root):
        run(result)
    for result in exports.export_rows(size, model, repeats, root):
        run(result)
    for result in exports.rss_rows(size, model, root):
        results.append(result)  # bytes, not seconds: only the targets table shows them
        shown = f"{result.median / 2**20:.1f} MiB" if result.median else result.status
        log(f"  [{size.name}] {result.label}: {shown} {result.note}".rstrip())
    for result in keras_rows(size, model, repeats, root):
        run(result)
    run(floor_row(size, repeats, root, reference_bytes(results)))
    del model
    keras.backend.clear_session()
    gc.collect()
    return results


def reference_bytes(results: list[Result]) -> int:
    """Bytes the floor writes: our SavedModel checkpoint, else the ``.keras`` file."""
    by_key = {r.key: r for r in results}
    for key in ("savedmodel.repeat_save", "keras.save"):
        if by_key.get(key) and by_key[key].nbytes:
            return by_key[key].nbytes
    raise RuntimeError("no checkpoint size to compare the floor with")


# ------------------------------------------------------------------- our backends
def savedmodel_rows(size: Size, model: keras.Model, repeats: int, root: Path, log) -> list[Result]:
    labels = {
        "savedmodel.first_save": "ours savedmodel: first save",
        "savedmodel.second_save": "ours savedmodel: second save of a model (its first repeat save)",
        "savedmodel.repeat_save": "ours savedmodel: repeat save after a train step",
        "savedmodel.load": "ours savedmodel: load, classes known",
        "savedmodel.load_missing": "ours savedmodel: load, custom class missing",
    }
    backend, why = savedmodel_backend()
    if backend is None:
        return [not_available(size.name, k, label, why) for k, label in labels.items()]

    first_dir = lambda i: root / f"sm_first_{i}"  # noqa: E731
    repeat_dir = lambda i: root / f"sm_repeat_{i}"  # noqa: E731
    fresh: dict[str, keras.Model] = {}

    def build_fresh(i: int) -> None:
        # A first save is the first save of a model object: a new one every repeat.
        fresh.pop("model", None)
        gc.collect()
        fresh["model"] = models.build(size, seed=1 + i, train=False)

    rows = [
        timed(
            size.name,
            "savedmodel.first_save",
            labels["savedmodel.first_save"],
            lambda i: backend.save(fresh["model"], first_dir(i)),
            repeats,
            before=build_fresh,
            artifact=first_dir,
            after=lambda i, _: remove(first_dir(i)),
        )
    ]
    fresh.clear()
    try:  # untimed first save of the trained model: the repeat saves reuse its traces
        backend.save(model, root / "sm_prime")
    except Exception as err:
        log(f"  [{size.name}] savedmodel save failed: {type(err).__name__}: {err}")
    # A model's second save is its first repeat save: any one-time cost of the repeat path
    # shows here (it traced the variables writer, 1.5-2 s on deep, until that writer ran
    # eagerly). One measurement, since only a new model pays it again; the repeat-save
    # median below is then the steady state.
    rows.append(
        timed(
            size.name,
            "savedmodel.second_save",
            labels["savedmodel.second_save"],
            lambda i: backend.save(model, root / "sm_second"),
            1,
            before=lambda i: models.train_step(model, size, seed=99),
            artifact=lambda i: root / "sm_second",
            after=lambda i, _: remove(root / "sm_second"),
        )
    )
    paired = Result(size.name, "floor_paired", PAIRED_FLOOR_LABEL)

    def before_repeat(i: int) -> None:
        # As in training, where retention (keep_last) deletes the oldest checkpoint after
        # each save, a repeat save follows a deletion of a checkpoint of its size: it
        # writes into pages the kernel just freed. Kept, each would write into freshly
        # allocated pages, which on this VM costs a large save 0.29-0.33 s instead of
        # 0.13 s (analysis.md); the `.keras` repeat saves are timed the same way.
        if i > 0:
            remove(repeat_dir(i - 1))
        models.train_step(model, size, seed=100 + i)

    rows.append(
        timed(
            size.name,
            "savedmodel.repeat_save",
            labels["savedmodel.repeat_save"],
            lambda i: backend.save(model, repeat_dir(i)),
            repeats,
            before=before_repeat,
            artifact=repeat_dir,
            after=lambda i, _: paired_floor(paired, disk_bytes(repeat_dir(i)), root),
        )
    )
    rows.append(paired)
    saved = repeat_dir(repeats - 1)
    notes: dict[str, str] = {}

    def note(key: str):
        return lambda i, checkpoint: notes.__setitem__(key, revival_note(checkpoint))

    rows.append(
        timed(
            size.name,
            "savedmodel.load",
            labels["savedmodel.load"],
            lambda i: backend.load(saved),
            repeats,
            after=note("load"),
        )
    )
    rows[-1].note = rows[-1].note or notes.get("load", "")
    if size.has_custom_class:
        with models.block_class_missing(size):
            missing = timed(
                size.name,
                "savedmodel.load_missing",
                labels["savedmodel.load_missing"],
                lambda i: backend.load(saved),
                repeats,
                after=note("missing"),
            )
        missing.note = missing.note or notes.get("missing", "")
        rows.append(missing)
    else:
        rows.append(
            not_available(
                size.name,
                "savedmodel.load_missing",
                labels["savedmodel.load_missing"],
                "model has no custom class",
            )
        )
    for i in range(repeats):
        remove(repeat_dir(i))
    remove(root / "sm_prime")
    return rows


def revival_note(checkpoint) -> str:
    """How the layers came back: from config (class known) or from traced functions; the
    custom blocks are counted apart, since the class-missing load is about them."""
    how = checkpoint.metadata.get("revived_from", {})
    blocks = [name for name in how if re.fullmatch(r"block\d+", name)]
    chosen, what = (blocks, "custom blocks") if blocks else (list(how), "layers")
    counts = collections.Counter(how[name] for name in chosen)
    if not counts:
        return ""
    note = f"{what} revived from " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    loaded = checkpoint.metadata.get("traced_functions_loaded")
    if loaded is not None:
        note += "; traced functions " + ("imported" if loaded else "not imported")
    return note


def backend_rows(size: Size, model: keras.Model, repeats: int, root: Path) -> list[Result]:
    from trainer.save_backends import get_backend

    rows = []
    for name in ("h5", "weights"):
        backend = get_backend(name)
        target = lambda i, b=backend, n=name: b.checkpoint_path(root / f"{n}_{i}")  # noqa: E731
        save = timed(
            size.name,
            f"{name}.save",
            f"ours {name}: save",
            lambda i, b=backend, t=target: b.save(model, t(i)),
            repeats,
            artifact=target,
        )
        rows.append(save)
        last = target(repeats - 1)
        rows.append(
            timed(
                size.name,
                f"{name}.load",
                f"ours {name}: load",
                lambda i, b=backend, p=last: b.load(p),
                repeats,
            )
            if save.status == "ok"
            else not_available(size.name, f"{name}.load", f"ours {name}: load", "save failed")
        )
        for i in range(repeats):
            remove(target(i))
    return rows


# ------------------------------------------------------------------------ Keras 3
def keras_rows(size: Size, model: keras.Model, repeats: int, root: Path) -> list[Result]:
    keras_file = lambda i: root / f"k3_{i}.keras"  # noqa: E731
    weights_file = lambda i: root / f"k3_{i}.weights.h5"  # noqa: E731
    export_dir = lambda i: root / f"k3_export_{i}"  # noqa: E731
    rows = [
        timed(
            size.name,
            "keras.save",
            'Keras 3 model.save("x.keras")',
            lambda i: model.save(keras_file(i)),
            repeats,
            # After the previous file's deletion, as trainer's repeat saves are timed (a
            # ModelCheckpoint with one file path overwrites it: its pages are freed too).
            before=lambda i: remove(keras_file(i - 1)) if i > 0 else None,
            artifact=keras_file,
        ),
        timed(
            size.name,
            "keras.save_weights",
            'Keras 3 model.save_weights("x.weights.h5")',
            lambda i: model.save_weights(weights_file(i)),
            repeats,
            artifact=weights_file,
            after=lambda i, _: remove(weights_file(i)),
        ),
        timed(
            size.name,
            "keras.export",
            "Keras 3 model.export(dir)",
            lambda i: model.export(str(export_dir(i)), verbose=False),
            repeats,
            artifact=export_dir,
            after=lambda i, _: remove(export_dir(i)),
        ),
    ]
    last = keras_file(repeats - 1)
    rows.append(
        timed(
            size.name,
            "keras.load",
            'Keras 3 keras.models.load_model("x.keras")',
            lambda i: keras.models.load_model(last),
            repeats,
        )
        if rows[0].status == "ok"
        else not_available(size.name, "keras.load", "Keras 3 load_model", "save failed")
    )
    for i in range(repeats):
        remove(keras_file(i))
    return rows


# -------------------------------------------------------------------------- floor
def write_and_fsync(path: Path, nbytes: int, buffer: bytes) -> None:
    """Create ``path``, write ``nbytes`` and fsync it and its directory: what any
    durable checkpoint of that size costs at least on this disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        view = memoryview(buffer)
        while left > 0:
            left -= os.write(fd, view[: min(left, len(buffer))])
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


PAIRED_FLOOR_LABEL = (
    "floor, informational: write + fsync the bytes of each repeat save, right after it"
)


def paired_floor(row: Result, nbytes: int, root: Path) -> None:
    """Time the floor for ``nbytes`` right after a repeat save, into ``row``: what the same
    write costs on the disk as the save leaves it. Informational: in the run that added it,
    this took 0.29-0.40 s against the quiet floor's 0.06 s and the save's own 0.21 s (it
    pays the journal and discard work the save and the previous removals left), so it
    shows the disk's state, and the floor target stays against the quiet floor row."""
    target = root / "floor_paired.bin"
    buffer = os.urandom(min(nbytes, FLOOR_CHUNK))  # incompressible, like weights
    start = time.perf_counter()
    write_and_fsync(target, nbytes, buffer)
    row.values.append(time.perf_counter() - start)
    row.nbytes = nbytes
    remove(target)


def floor_row(size: Size, repeats: int, root: Path, nbytes: int) -> Result:
    buffer = os.urandom(min(nbytes, FLOOR_CHUNK))  # incompressible, like weights
    target = lambda i: root / f"floor_{i}.bin"  # noqa: E731
    return timed(
        size.name,
        "floor",
        f"floor: write + fsync {nbytes:,} bytes",
        lambda i: write_and_fsync(target(i), nbytes, buffer),
        repeats,
        artifact=target,
        after=lambda i, _: remove(target(i)),
    )
