"""Serving export and save-memory rows (issue 17): trainer's serving export (what
``python -m trainer export`` and the end of ``train(cfg)`` write) against Keras 3's own
``model.export`` of the same model, and the peak resident memory a checkpoint save adds."""

from __future__ import annotations

import functools
import gc
import threading
import time
from pathlib import Path

import keras

from benchmarks.specs import Size
from benchmarks.timing import ERROR, Result, disk_bytes, not_available, remove, timed

RSS_SIZES = ("large", "tiny")  # tiny: --quick only
SAMPLE_SECONDS = 0.002


def export_rows(size: Size, model: keras.Model, repeats: int, root: Path) -> list[Result]:
    """``trainer.exports.exporter.export_serving`` of the trained model, without warmup
    requests, its trace cache emptied before every repeat: an export comes from a model loaded
    from a checkpoint (the CLI) or from a live model whose checkpoints were written from the
    async shadow copy, so in practice it traces; Keras' ``model.export`` traces every time too."""
    label = "ours serving export (python -m trainer export; no optimizer)"
    try:
        from trainer.exports.exporter import export_serving
        from trainer.save_backends.savedmodel.save import trace_cache
    except Exception as err:  # not in this checkout: said so, never estimated
        return [not_available(size.name, "savedmodel.export", label, f"{err}"[:200])]
    made: dict[int, Path] = {}

    def export(i: int) -> Path:
        made[i] = export_serving(model, root / f"ours_export_{i}", keep=1)
        return made[i]

    paired = Result(size.name, "keras.export_paired", PAIRED_LABEL)

    # Alternate which of the pair goes first: whichever runs second finds kernels and
    # TensorFlow's tracing machinery warm (Keras' export right after ours took 0.33 s on
    # small, 0.53 s alone in the same run).
    def before(i: int) -> None:
        if i % 2:
            keras_export(paired, model, root)
        trace_cache.clear()

    def after(i: int, _: Path) -> None:
        remove(root / f"ours_export_{i}")
        if not i % 2:
            keras_export(paired, model, root)

    row = timed(
        size.name,
        "savedmodel.export",
        label,
        export,
        repeats,
        before=before,
        artifact=lambda i: made[i],
        after=after,
    )
    trace_cache.clear()
    return [row, paired]


PAIRED_LABEL = "Keras 3 model.export(dir), paired with each of ours (alternately after, before)"


def keras_export(row: Result, model: keras.Model, root: Path) -> None:
    """Keras' ``model.export`` of the same model timed next to each of our exports, so that
    the export-time target compares exports made back to back, in the same state of
    the machine (the separate ``keras.export`` row runs a minute later; in one run the two
    rows' ratio moved from 0.81x to 1.18x between machines while each export alone moved
    less). A failure makes the row an error row, never a number."""
    if row.status == ERROR:
        return
    target = root / "keras_export_paired"
    try:
        gc.collect()
        start = time.perf_counter()
        model.export(str(target), verbose=False)
        row.values.append(time.perf_counter() - start)
        row.nbytes = disk_bytes(target)
    except Exception as err:  # reported in the table
        row.status, row.note, row.values = ERROR, f"{type(err).__name__}: {err}"[:200], []
    finally:
        remove(target)


def variable_bytes(model: keras.Model) -> int:
    """Bytes of every variable a checkpoint holds (weights, optimizer slots, counters)."""
    optimizer = getattr(model, "optimizer", None)
    variables = [*model.variables, *(optimizer.variables if optimizer is not None else [])]
    return sum(int(v.numpy().nbytes) for v in variables)


def rss_rows(size: Size, model: keras.Model, root: Path) -> list[Result]:
    """Peak RSS growth (bytes) during one repeat savedmodel save of the trained model, sync
    and async (snapshot copy plus background write), next to the variables' own bytes."""
    keys = {
        "savedmodel.save_rss": "ours savedmodel: repeat save, peak RSS growth",
        "savedmodel.async_save_rss": "ours savedmodel: async save, peak RSS growth",
    }
    if size.name not in RSS_SIZES:
        return []
    try:
        from trainer.checkpointing import CheckpointManager, CheckpointPolicy
        from trainer.save_backends import get_backend
    except Exception as err:
        return [not_available(size.name, k, label, f"{err}"[:200]) for k, label in keys.items()]
    nbytes = variable_bytes(model)
    rows = []
    for key, label in keys.items():
        row = Result(size.name, key, label, unit="bytes", nbytes=nbytes)
        directory = root / key
        try:
            manager = CheckpointManager(
                directory,
                get_backend("savedmodel"),
                CheckpointPolicy(keep_last=1, async_save=key.startswith("savedmodel.async")),
            )
            manager.save(model, wait=True)  # primes traces (and the async shadow copy)
            model.optimizer.iterations.assign_add(1)  # a new step, so the next save writes
            growth = peak_growth(functools.partial(manager.save, model, wait=True))
            manager.close()
        except Exception as err:  # reported in the table, never a number
            row.status, row.note = ERROR, f"{type(err).__name__}: {str(err)[:200]}"
        else:
            if growth > 0:
                row.values = [float(growth)]
            else:
                row.status, row.note = "n/a", "no RSS growth measurable"
        finally:
            remove(directory)
        rows.append(row)
    return rows


def peak_growth(action) -> int:
    """Highest resident set size while ``action`` runs, minus the one before it, sampled
    every 2 ms from ``/proc/self/statm`` (the kernel's own peak cannot be reset per call
    without privileges on every kernel)."""
    gc.collect()
    page = _page_size()
    start = _rss_pages() * page
    peak = [start]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_pages() * page)
            time.sleep(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _rss_pages() * page)
    return peak[0] - start


def _rss_pages() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1])


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")
