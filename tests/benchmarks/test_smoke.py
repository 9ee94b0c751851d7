"""Smoke of the benchmark command: ``python -m benchmarks.run --quick`` runs end to end and
every row of its report carries measured numbers, or says why it has none."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


def run_quick_benchmark(tmp_path, *extra, pythonpath=()):
    """``python -m benchmarks.run --quick`` in a child; returns its JSON results."""
    raw = tmp_path / "results.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    paths = [*map(str, pythonpath), str(ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    command = [
        sys.executable, "-m", "benchmarks.run", "--quick",
        "--workdir", str(tmp_path / "work"), "--json", str(raw), *extra,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(raw.read_text()), proc.stdout


@pytest.mark.slow
def test_quick_benchmark_reports_numbers_for_every_row(tmp_path):
    output = tmp_path / "report.md"
    payload, _ = run_quick_benchmark(tmp_path, "--output", str(output))
    rows = {(r["size"], r["key"]): r for r in payload["results"]}

    # Every row is either measured (finite positive numbers, min <= median <= max) or
    # explicitly not available with a reason; errors are failures of the harness.
    for (size, key), row in rows.items():
        assert row["status"] in ("ok", "n/a"), f"{size}/{key}: {row['status']} {row['note']}"
        if row["status"] == "ok":
            assert row["values"], f"{size}/{key} claims a figure but has no values"
            assert all(math.isfinite(v) and v > 0 for v in row["values"]), (size, key, row)
            assert row["min"] <= row["median"] <= row["max"]
        else:
            assert row["note"], f"{size}/{key} is n/a without saying why"

    # The anchors and our always-present backends must be measured, not skipped.
    measured = {
        "keras.save",
        "keras.save_weights",
        "keras.export",
        "keras.load",
        "tf_keras.save",
        "tf_keras.load",
        "h5.save",
        "h5.load",
        "weights.save",
        "weights.load",
        "floor",
    }
    # savedmodel may only be missing if the backend cannot be imported in this checkout.
    first = rows[("tiny", "savedmodel.first_save")]
    if not (first["status"] == "n/a" and first["note"].startswith("not available")):
        measured |= {"savedmodel.first_save", "savedmodel.repeat_save", "savedmodel.load"}
        measured.add("savedmodel.load_missing")
        assert (
            "custom blocks revived from traced" in rows[("tiny", "savedmodel.load_missing")]["note"]
        ), "the class-missing load must revive the custom blocks from traced functions"
        assert "custom blocks revived from config" in rows[("tiny", "savedmodel.load")]["note"]
    for key in measured:
        assert rows[("tiny", key)]["status"] == "ok", rows[("tiny", key)]
    assert rows[("training", "train.none")]["status"] == "ok"
    assert rows[("training", "train.sync_h5")]["status"] == "ok"

    # The markdown shows each measured row with its median, as printed from the results.
    report = output.read_text()
    for (_size, key), row in rows.items():
        if row["status"] == "ok" and row["unit"] == "s":
            line = next(x for x in report.splitlines() if x.startswith(f"| {row['label']} |"))
            assert f"| {row['median']:.3f} |" in line, (key, line)
    assert "## Targets (issues 7 and 17)" in report
    assert payload["command"].startswith("python -m benchmarks.run")


def test_without_tf_keras_the_anchor_rows_say_not_available(tmp_path, monkeypatch):
    """A fresh ``pip install -e .`` has no tf_keras: the anchor child exits at once and its
    rows say so and how to install it, as not-available rows (never harness errors, so the
    rest of the benchmark, which ``benchmarks.run`` measures independently of the anchor as
    the test above shows, still reports). The child is waited for before the parent sends
    its "go", so the closed pipe that race produces is exercised every time."""
    blocker = tmp_path / "blocked"
    (blocker / "tf_keras").mkdir(parents=True)
    (blocker / "tf_keras" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'tf_keras' (blocked by the test)\")\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocker), str(ROOT)]))
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import run

    workdir = tmp_path / "work"
    workdir.mkdir()
    args = run.parse_args(["--quick", "--workdir", str(workdir)])
    anchor = run.Anchor(args, run.repeats_for(args), workdir)
    assert anchor.proc.wait(timeout=600) == 0  # exited without waiting for "go"
    lines: list[str] = []
    rows = anchor.results(lines.append)
    assert {(r.size, r.key) for r in rows} == {("tiny", "tf_keras.save"), ("tiny", "tf_keras.load")}
    for row in rows:
        assert row.status == "n/a", row
        assert "tf_keras cannot be imported" in row.note, row
        assert "blocked by the test" in row.note, row
        assert "pip install -e '.[bench]'" in row.note, row
    assert any("not available" in line for line in lines), lines


def test_async_cost_compares_each_saves_epochs_with_the_clean_pair_after_them(monkeypatch):
    """``benchmarks.async_cost`` charges a save with the extra time of the epoch it is
    taken at and the next one over the two clean epochs after them, per clean epoch."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.async_cost import pair_costs

    every, epochs = 4, 32
    durations = [0.100] * epochs
    durations[0] = 2.0  # the first epoch traces: never part of a pair
    for at in range(every - 1, epochs, every):  # 0-based epochs that end with a save
        durations[at] += 0.004  # the snapshot
        if at + 1 < epochs:
            durations[at + 1] += 0.006  # the write overlapping the next epoch
    costs = pair_costs(durations, every)
    # The first two saves are left out (3 and 7, 0-based); 31 ends the run, no pair after.
    assert len(costs) == 5  # 11, 15, 19, 23, 27
    assert costs == pytest.approx([0.10] * 5)


def _main_output(module, argv, capsys) -> str:
    """``module.main(argv)`` in this process (the command's whole path but its
    ``__main__`` line, which ``python -m benchmarks.run`` above covers: a child would
    only add a TensorFlow import); returns what it printed."""
    capsys.readouterr()
    assert module.main(argv) == 0
    return capsys.readouterr().out


def test_async_cost_quick_run_reports_a_figure(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import async_cost

    # One run: its three pairs already take the spread line's path; a second run in the
    # same process is what test_async_cost_files_floor_... above does (run_once twice).
    out = _main_output(async_cost, ["--quick", "--epochs", "24", "--runs", "1"], capsys)
    line = out.strip().splitlines()[-1]
    assert line.startswith("writer=real: 3 saves"), line  # saves 11, 15, 19 (0-based)
    assert "standard error" in line, line
    assert "% of an epoch (median)" in line, line


def test_async_cost_files_floor_writes_the_checkpoints_files_and_keeps_the_last_three(
    monkeypatch, tmp_path
):
    """The ``files`` stand-in: trainer's first checkpoint, then its files again by hand (the
    no file shared), each save renamed into place; ``keep_last`` (3) kept."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import async_cost
    from trainer.checkpointing import manager

    real = manager.CheckpointManager._write
    monkeypatch.setattr(manager.CheckpointManager, "_write", async_cost.files_floor(real))
    async_cost.run_once(24, 4, tmp_path / "first", quick=True)
    async_cost.run_once(24, 4, tmp_path / "run", quick=True)  # a second run, same process
    kept = sorted(p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir())
    assert [p.name for p in kept] == ["step-00000016", "step-00000020", "step-00000024"]
    trees = [
        {str(f.relative_to(p)): f.read_bytes() for f in p.rglob("*") if f.is_file()} for p in kept
    ]
    assert trees[0] == trees[1] == trees[2]
    assert {"saved_model.pb", "variables/variables.index"} <= set(trees[0])
    assert all(f.stat().st_nlink == 1 for p in kept for f in p.rglob("*") if f.is_file())
    assert not [p for p in kept[0].parent.iterdir() if p.name.startswith(".")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD is Linux only")
def test_writer_cpu_reports_the_cpu_of_repeat_saves(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import writer_cpu

    line = _main_output(writer_cpu, ["--saves", "8"], capsys).strip().splitlines()[-1]
    assert line.startswith("writer CPU per repeat savedmodel save: "), line
    assert "(median of 3)" in line and "system" in line, line
    assert float(line.split(": ")[1].split(" ms")[0]) > 0, line


def test_side_by_side_child_reports_a_runs_figures(monkeypatch, capsys):
    """What each process of ``benchmarks.side_by_side`` prints, on the smoke-sized run."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import side_by_side

    side_by_side.child("async_savedmodel", quick=True)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    figures = json.loads(line[len("RESULT ") :])
    assert figures["steps"] > 0 and figures["run"] > 0
    assert figures["blocking"] and all(b >= 0 for b in figures["blocking"])


def test_repeat_pages_reports_both_kinds_of_repeat_save(monkeypatch, capsys):
    """``benchmarks.repeat_pages`` times the same repeat save kept and after a deletion."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import repeat_pages

    out = _main_output(repeat_pages, ["--size", "tiny", "--saves", "2"], capsys)
    lines = [line for line in out.splitlines() if "repeat save" in line]
    assert [line.split(",")[1].split(":")[0].strip() for line in lines] == [
        "kept",
        "after a deletion",
    ]
    assert all(len(line.split("(")[1].split(",")) == 2 for line in lines)  # two saves each


@pytest.mark.slow
def test_load_pair_reports_both_loads_and_how_the_blocks_came_back(tmp_path, monkeypatch):
    """``benchmarks.load_pair``: ours and ``.keras`` timed each repeat, the blocks from config."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import load_pair

    out = tmp_path / "pair.json"
    assert load_pair.main(["--sizes", "tiny", "--repeats", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert len(row["times"]["ours"]) == len(row["times"]["keras"]) == 2
    assert row["ratio"] > 0 and "revived from config: 2" in row["note"]


def test_store_cost_reports_ours_and_the_s3fs_floor_side_by_side(monkeypatch, capsys):
    """``benchmarks.store_cost`` on the tiny model: its own moto server on 127.0.0.1, every
    row measured, and the ratio to the plain s3fs transfer printed beside ours."""
    monkeypatch.syspath_prepend(str(ROOT))
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "restored after the test")  # the benchmark sets them
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("TRAINER_STORE_CACHE", "restored after the test")
    from benchmarks import store_cost

    out = _main_output(
        store_cost, ["--sizes", "tiny", "--backends", "weights", "--repeats", "1"], capsys
    )
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| tiny |")]
    assert {row[3] for row in rows} == set(store_cost.ROWS.values()), out
    for row in rows:
        assert float(row[4]) > 0, row  # the median, measured
        if row[3] in (store_cost.ROWS[key] for key in store_cost.FLOORS):
            assert row[7].rstrip(" |").endswith("x") and float(row[7].rstrip(" |x")) > 0, row
    assert int(rows[0][2].replace(",", "")) > 0  # the checkpoint's bytes
