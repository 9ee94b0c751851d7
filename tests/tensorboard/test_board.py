"""TensorBoard side of a run, read back with TensorBoard itself: EventAccumulator on the
event files, and a real ``tensorboard`` server queried over HTTP."""

from __future__ import annotations

import math
import shutil
import threading
from pathlib import Path

import pytest
import tensorflow as tf
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hp_metadata
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from tests.helpers.tb_runs import make_run, tensorboard_server, wait_for
from trainer.errors import TensorBoardLinkError, TensorBoardWriteError
from trainer.save_backends import backend_class, load_checkpoint
from trainer.storage.integrity import total_size
from trainer.tensorboard.board import RunBoard, card_tag, config_hash, flatten_config
from trainer.tensorboard.links import event_steps, resolve_link


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("outputs") / "run0", backends=("h5", "weights"))


def accumulator(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def scalar(event) -> float:
    return float(tensor_util.make_ndarray(event.tensor_proto))


def test_flatten_config_turns_nested_config_into_scalar_hparams():
    cfg = OmegaConf.create(
        {"a": {"b": 1, "c": {"d": "x"}}, "lr": "${a.b}", "hidden": [16, 8], "none": None}
    )
    flat = flatten_config(cfg)
    assert flat == {"a.b": 1, "a.c.d": "x", "lr": 1, "hidden": "[16, 8]", "none": "null"}
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())


def test_config_hash_ignores_where_the_run_writes_but_not_what_it_computes():
    base = {"seed": 0, "run_dir": "/a", "optimizer": {"learning_rate": 0.1}}
    moved = {**base, "run_dir": "/b"}
    changed = {**base, "optimizer": {"learning_rate": 0.2}}
    assert config_hash(base) == config_hash(moved) == config_hash(OmegaConf.create(moved))
    assert config_hash(base) != config_hash(changed)
    assert len(config_hash(base)) == 12


def test_event_files_hold_cards_scalars_hparams_and_graph(run):
    acc = accumulator(run["run_dir"] / "tb")
    tags = acc.Tags()
    for saved in run["checkpoints"]:
        tag = f"checkpoints/{saved['path'].name}"
        (event,) = acc.Tensors(tag)
        assert event.step == saved["step"]
        card = event.tensor_proto.string_val[0].decode()
        assert f"`checkpoints/{saved['path'].name}`" in card  # relative to the run directory
        version = backend_class(saved["backend"]).format_version
        assert f"{saved['backend']} (format version {version})" in card
        assert f"{total_size(saved['path']):,} B" in card
        assert f"`{run['config_hash']}`" in card
        assert f"{saved['metrics']['loss']:.6g}" in card
    sizes = {e.step: scalar(e) for e in acc.Tensors("checkpoint/size_bytes")}
    assert sizes == {s["step"]: float(total_size(s["path"])) for s in run["checkpoints"]}
    seconds = [scalar(e) for e in acc.Tensors("checkpoint/save_seconds")]
    assert len(seconds) == 2 and all(math.isfinite(s) and s > 0 for s in seconds)
    (final,) = acc.Tensors("final/val_loss")
    assert scalar(final) == pytest.approx(run["final"]["val_loss"])

    content = acc.PluginTagToContent(hp_metadata.PLUGIN_NAME)[hp_metadata.SESSION_START_INFO_TAG]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    expected = flatten_config(run["config"])
    assert set(info.hparams) == set(expected)
    assert info.hparams["optimizer.name"].string_value == "adam"
    assert info.hparams["optimizer.learning_rate"].number_value == pytest.approx(0.01)

    assert tags["graph"] is True
    ops = {node.op for node in acc.Graph().node}
    assert {"MatMul", "BiasAdd", "Relu", "Placeholder"} <= ops


def test_checkpoint_links_resolve_to_the_event_file_holding_their_step(run, tmp_path):
    for saved in run["checkpoints"]:
        checkpoint = load_checkpoint(saved["path"], compile=False)
        link = checkpoint.metadata["tensorboard"]
        assert link["step"] == saved["step"] and link["log_dir"] == "tb"
        assert link["run_name"] == "run0/tb"
        assert link["event_file"] == run["event_file"].name
        resolved = resolve_link(saved["path"], checkpoint.metadata)
        assert resolved.event_file == run["event_file"] and resolved.event_file.is_file()
        assert f"checkpoints/{saved['path'].name}" in resolved.tags
        assert saved["step"] in event_steps(resolved.event_file)

    # Moving the whole run directory keeps the link working (it is relative)...
    moved = tmp_path / "moved"
    shutil.copytree(run["run_dir"], moved)
    shutil.rmtree(run["run_dir"] / "tb")
    try:
        first = run["checkpoints"][0]
        path = moved / "checkpoints" / first["path"].name
        meta = load_checkpoint(path, compile=False).metadata
        assert resolve_link(path, meta).event_file == moved / "tb" / run["event_file"].name
        # ...and a missing log is reported, not ignored.
        with pytest.raises(TensorBoardLinkError, match="is gone"):
            resolve_link(first["path"], meta)
    finally:
        shutil.copytree(moved / "tb", run["run_dir"] / "tb")


def test_a_link_to_a_step_without_card_is_reported(tmp_path):
    with RunBoard(tmp_path / "tb", run_dir=tmp_path) as board:
        board.checkpoint_card(3, tmp_path / "ckpt.h5", backend="h5", format_version=1)
        good = board.link(3, tmp_path / "ckpt.h5", tag="checkpoints/ckpt.h5")
        bad_step = board.link(4, tmp_path / "ckpt.h5")
        bad_tag = board.link(3, tmp_path / "ckpt.h5", tag="checkpoints/other.h5")
    assert resolve_link(tmp_path / "ckpt.h5", good).step == 3
    with pytest.raises(TensorBoardLinkError, match="no event at step 4"):
        resolve_link(tmp_path / "ckpt.h5", bad_step)
    with pytest.raises(TensorBoardLinkError, match=r"other\.h5"):
        resolve_link(tmp_path / "ckpt.h5", bad_tag)
    with pytest.raises(TensorBoardLinkError, match="no TensorBoard link"):
        resolve_link(tmp_path / "ckpt.h5", {"backend": "h5"})


@pytest.mark.slow
def test_tensorboard_server_lists_runs_scalars_hparams_and_cards(tmp_path):
    """Two runs of a "multirun" (adam vs sgd) under one directory, served by TensorBoard."""
    with tensorboard_server(tmp_path) as get:  # starts now, answers once runs exist
        runs = [
            make_run(tmp_path / "0", optimizer="adam", learning_rate=0.01),
            make_run(tmp_path / "1", optimizer="sgd", learning_rate=0.1),
        ]
        names = wait_for(get, "/data/runs", lambda r: len(r) == 2)
        assert sorted(names) == ["0/tb", "1/tb"]

        # TensorBoard may have read a run's event file while it was still being written:
        # wait until a later reload has every tag of both runs (a timeout still fails below).
        wanted = {"checkpoint/size_bytes", "checkpoint/save_seconds", "final/val_loss"}
        scalars = wait_for(
            get,
            "/data/plugin/scalars/tags",
            lambda r: all(wanted <= set(r.get(name, ())) for name in names),
        )
        for name in names:
            assert wanted <= set(scalars[name])

        texts = wait_for(get, "/data/plugin/text/tags", lambda r: len(r.get("0/tb", ())) == 2)
        assert sorted(texts["0/tb"]) == ["checkpoints/epoch-001.h5", "checkpoints/epoch-002.h5"]
        card = get("/data/plugin/text/text?run=0/tb&tag=checkpoints/epoch-002.h5")
        assert card[0]["step"] == runs[0]["checkpoints"][1]["step"]
        assert "checkpoints/epoch-002.h5" in card[0]["text"]
        assert "<table>" in card[0]["text"]  # the markdown table was rendered

        experiment = wait_for(
            get,
            "/data/plugin/hparams/experiment",
            lambda r: (
                any(len(h.get("domainDiscrete", ())) == 2 for h in r.get("hparamInfos", ()))
                and len(r.get("metricInfos", ())) > 0
            ),
            {"experimentName": ""},
        )
        infos = {h["name"]: h for h in experiment["hparamInfos"]}
        assert sorted(infos["optimizer.name"]["domainDiscrete"]) == ["adam", "sgd"]
        assert infos["optimizer.name"]["differs"] is True
        metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
        assert "final/val_loss" in metrics

        groups = get(
            "/data/plugin/hparams/session_groups",
            {
                "experimentName": "",
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_RUNNING"],
                "colParams": [{"hparam": "optimizer.name"}, {"metric": {"tag": "final/val_loss"}}],
                "startIndex": 0,
                "sliceSize": 10,
            },
        )
        assert groups["totalSize"] == 2
        by_optimizer = {
            g["hparams"]["optimizer.name"]: g["sessions"][0] for g in groups["sessionGroups"]
        }
        assert set(by_optimizer) == {"adam", "sgd"}
        for r, name in zip(runs, ["adam", "sgd"], strict=True):
            (value,) = [
                m["value"]
                for m in by_optimizer[name]["metricValues"]
                if m["name"]["tag"] == "final/val_loss"
            ]
            assert value == pytest.approx(r["final"]["val_loss"], rel=1e-5)

        graphs = get("/data/plugin/graphs/info")
        assert graphs["0/tb"]["run_graph"] is True


def test_cards_from_a_background_thread_land_next_to_main_thread_scalars(tmp_path):
    """Async checkpoint writers card from their own thread while training logs scalars."""
    board = RunBoard(tmp_path / "tb", run_dir=tmp_path)

    def write_cards():
        for step in range(1, 21):
            board.checkpoint_card(
                step, tmp_path / f"c{step}", backend="h5", format_version=1, size_bytes=step
            )

    thread = threading.Thread(target=write_cards)
    thread.start()
    with board.writer.as_default():
        for step in range(1, 201):
            tf.summary.scalar("batch/loss", 1.0 / step, step=step)
    thread.join()
    board.close()
    steps = event_steps(board.event_file)
    assert all(f"checkpoints/c{s}" in steps[s] for s in range(1, 21))
    assert all("batch/loss" in steps[s] for s in range(1, 201))


def test_a_restart_within_the_second_of_the_old_events_still_purges_them(tmp_path):
    """A short run resumed at once: its event files and the restart marker share a second,
    where the marker's name ("<second>.+session...") sorted before the old file and was
    read first, so the re-trained steps showed twice (seen in CI under load)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import (
        EventAccumulator as PluginAccumulator,
    )

    from trainer.training.progress import mark_session_start

    def session(first_step, last_step):
        mark_session_start(tmp_path, first_step - 1)
        writer = tf.summary.create_file_writer(str(tmp_path))
        with writer.as_default():
            for step in range(first_step, last_step + 1):
                tf.summary.scalar("batch/loss", float(step), step=step)
        writer.close()

    session(1, 6)
    session(4, 6)  # resumed from step 3, right away
    events = PluginAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("batch/loss")] == [1, 2, 3, 4, 5, 6]


def test_sessions_on_a_host_whose_name_sorts_first_are_not_purged(tmp_path):
    """TensorBoard reads a directory's event files in name order. The restart marker was
    named "<second>.0session...": on a host named like a container id starting with 0
    ("0a1b2c3d"), a resumed session's own file sorted before its marker, and TensorBoard
    purged that session's events. And the run's first marker, which TensorBoard takes as
    the start of the run, was counted as a restart by the link checks."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import (
        EventAccumulator as PluginAccumulator,
    )
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from trainer.tensorboard.links import LogView
    from trainer.training.progress import mark_session_start

    def session(first_step, last_step):
        mark_session_start(tmp_path, first_step - 1)
        second = max(int(p.name.split(".")[3]) for p in tmp_path.glob("events.out.tfevents.*"))
        name = tmp_path / f"events.out.tfevents.{second}.0a1b2c3d.{first_step}.v2"
        with tf.io.TFRecordWriter(str(name)) as records:
            records.write(event_pb2.Event(file_version="brain.Event:2").SerializeToString())
            for step in range(first_step, last_step + 1):
                value = summary_pb2.Summary.Value(tag="loss", simple_value=float(step))
                event = event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))
                records.write(event.SerializeToString())

    session(1, 6)
    session(4, 8)  # resumed from step 3
    events = PluginAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("loss")] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [step for _name, step in LogView.read(tmp_path).restarts] == [4]


def test_a_log_directory_that_cannot_be_created_is_named_in_plain_words(tmp_path):
    """The message read "Writing TensorBoard the log directory to .../tb failed": the
    operations are named as such now ("creating the log directory")."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the run's directories should be")
    with pytest.raises(TensorBoardWriteError) as refused:
        RunBoard(blocker / "tb", run_dir=tmp_path)
    message = str(refused.value)
    assert message.startswith(f"TensorBoard log {blocker / 'tb'}: creating the log directory")
    assert "Writing TensorBoard the" not in message
    assert "Received: NotADirectoryError" in message


SESSIONS_BY = {  # the HParams tab's query: every session, with one metric column
    "experimentName": "",
    "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_RUNNING"],
    "colParams": [{"metric": {"tag": "final/val_loss"}}],
    "startIndex": 0,
    "sliceSize": 10,
}


def _session_values(answer: dict) -> list[tuple[str, float]]:
    """(session name, final/val_loss) of every session the HParams tab lists."""
    return [
        (session["name"], metric["value"])
        for group in answer.get("sessionGroups", ())
        for session in group["sessions"]
        for metric in session.get("metricValues", ())
        if metric["name"]["tag"] == "final/val_loss"
    ]


def test_the_printed_tensorboard_command_shows_the_runs_hparams_metrics(tmp_path):
    """Opened with the command trainer printed (``--logdir <run>/tb``), TensorBoard named
    the run "." and its HParams tab showed the session without any metric value. The
    command now names the run's parent: the run is ``<run>/tb``, as inspect names it."""
    from trainer.tensorboard.board import tensorboard_command

    run = make_run(tmp_path / "run-a", optimizer="adam", learning_rate=0.01)
    command = tensorboard_command(run["run_dir"])
    assert command.startswith("tensorboard --logdir ")
    with tensorboard_server(Path(command.split("--logdir ", 1)[1])) as get:
        path = "/data/plugin/hparams/session_groups"
        answer = wait_for(get, path, _session_values, SESSIONS_BY)
    (session,) = _session_values(answer)
    assert session[0] == "run-a/tb"  # as RunBoard.run_name, inspect and the links name it
    assert session[1] == pytest.approx(run["final"]["val_loss"], rel=1e-5)


def test_the_card_of_a_checkpoint_retention_deleted_says_so(tmp_path):
    """The Text tab showed every checkpoint's card as if it could still be loaded, also
    after retention deleted it; its tag now ends on a "deleted" entry at the step of the
    save whose retention removed it."""
    import keras

    from trainer.checkpointing import CheckpointManager, CheckpointPolicy
    from trainer.state import TrainingState

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    policy = CheckpointPolicy(keep_last=1, keep_best=0, async_save=False)
    board = RunBoard(tmp_path / "tb", run_dir=tmp_path)
    with CheckpointManager(tmp_path / "ckpt", "h5", policy, board=board) as manager:
        for step in (1, 2, 3):
            manager.save(model, TrainingState(global_step=step, epoch=step))
    board.close()
    texts = accumulator(tmp_path / "tb").Tensors
    entries = {}
    for name in ("step-00000001.h5", "step-00000002.h5", "step-00000003.h5"):
        tag = card_tag("checkpoint", name)
        entries[name] = [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in texts(tag)
        ]
    assert [step for step, _ in entries["step-00000001.h5"]] == [1, 2]
    assert "**deleted** by retention at step 2" in entries["step-00000001.h5"][-1][1]
    assert "**deleted** by retention at step 3" in entries["step-00000002.h5"][-1][1]
    assert [s for s, _ in entries["step-00000003.h5"]] == [3]  # kept: its card alone
    assert "deleted" not in entries["step-00000003.h5"][0][1]
