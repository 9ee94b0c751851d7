"""The HParams tab of a resumed run shows its latest session's config (issue 16, item 15).

Before: every session wrote its hparams into the run's ``tb/``, but TensorBoard's HParams
plugin keeps the first ``session_start_info`` metadata it reads per run, so after
``python train.py resume=latest resume_dir=R trainer.epochs=3`` the tab still said
``trainer.epochs=2``. Read here with TensorBoard's own code: the multiplexer and data provider
TensorBoard serves from, the HParams plugin's ``list_session_groups`` handler (what the tab
shows) and its metadata parser. The rewrite of earlier event files is checked for what it
must never do: lose a record, leave a half-written file under a real name when the process
is killed midway (SIGKILL at random moments, and the kernel's SIGXFSZ at a fixed point in
the middle of the copy), or touch the file of a writer that is still alive.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import (
    api_pb2,
    backend_context,
    list_session_groups,
    plugin_data_pb2,
)
from tensorboard.plugins.hparams import metadata as hp_metadata

from tests.helpers.paths import CONF_DIR
from tests.helpers.processes import subprocess_env
from tests.helpers.train_py import TINY_ARGS, train_py
from trainer.tensorboard.hparams import REPLACED_PREFIX, frame, replace_earlier_hparams
from trainer.tensorboard.links import event_steps

STATUSES = [api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_RUNNING]


def session_groups(logdir: Path):
    """What the HParams tab lists for ``logdir``: the plugin's own handler over the data
    provider TensorBoard serves from (``--load_fast=false``)."""
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    tb_context = base_plugin.TBContext(data_provider=provider, multiplexer=mux, logdir=logdir)
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=100, allowed_statuses=STATUSES
    )
    handler = list_session_groups.Handler(
        context.RequestContext(), backend_context.Context(tb_context), "", request
    )
    return list(handler.run().session_groups)


def start_info(log_dir: Path):
    """The ``session_start_info`` TensorBoard's accumulator keeps for the run ``log_dir``."""
    acc = accumulator(log_dir)
    content = acc.PluginTagToContent(hp_metadata.PLUGIN_NAME)[hp_metadata.SESSION_START_INFO_TAG]
    return hp_metadata.parse_session_start_info_plugin_data(content)


def accumulator(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def payloads(path: Path) -> list[bytes]:
    """Every record of an event file as TensorBoard's loader reads it (CRCs checked)."""
    return list(RawEventFileLoader(str(path)).Load())


def hparams_files(log_dir: Path) -> list[Path]:
    return [
        p for p in sorted(log_dir.glob("*tfevents*")) if b"session_start_info" in p.read_bytes()
    ]


# ------------------------------------------------------- a run and its resumed session
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A finished 2-epoch run of a real ``python train.py`` process, then its resume with
    more epochs, ``resume=latest resume_dir=R trainer.epochs=3``, composed from ``conf/`` as
    train.py composes it and trained by ``train(cfg)`` in this test process: another process
    than the first session's, as a CLI resume is, with one TensorFlow start-up less."""
    from hydra import compose, initialize_config_dir

    from trainer import train

    run = tmp_path_factory.mktemp("hparams") / "run"
    first = train_py(*TINY_ARGS, f"hydra.run.dir={run}")
    assert first.returncode == 0, first.output[-3000:]
    tb = run / "tb"
    (first_file,) = hparams_files(tb)
    before = {p.name: payloads(p) for p in tb.glob("*tfevents*")}
    more = [x for x in TINY_ARGS if not x.startswith("trainer.epochs=")] + ["trainer.epochs=3"]
    resume = ["resume=latest", f"resume_dir={run}", f"run_dir={run}"]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        assert train(compose("config", overrides=[*more, *resume]))
    return run, first_file, before


@pytest.mark.slow
def test_the_hparams_tab_shows_the_resumed_sessions_config(resumed):
    """Before the fix: trainer.epochs 2 and resume null (the first session's)."""
    run, _, _ = resumed
    (group,) = session_groups(run)
    assert group.hparams["trainer.epochs"].number_value == 3
    assert group.hparams["resume"].string_value == "latest"
    assert group.hparams["resume_dir"].string_value == str(run)
    (session,) = group.sessions
    assert session.name == "tb"
    # The metrics of the whole run stay linked to it: the last values, step 9 of 9.
    metrics = {m.name.tag: m for m in session.metric_values}
    assert metrics["final/val_loss"].training_step == 9
    assert metrics["epoch/loss"].training_step == 9
    assert start_info(run / "tb").hparams["trainer.epochs"].number_value == 3
    assert len(hparams_files(run / "tb")) == 1  # one session_start_info left in the run


@pytest.mark.slow
def test_scalars_and_cards_of_every_session_survive(resumed):
    run, first_file, before = resumed
    acc = accumulator(run / "tb")
    assert [e.step for e in acc.Tensors("epoch/loss")] == [3, 6, 9]
    assert [e.step for e in acc.Tensors("batch/loss")] == list(range(1, 10))
    assert [e.step for e in acc.Tensors("checkpoint/save_seconds")] == [3, 6, 9]
    for step in (3, 6, 9):
        assert len(acc.Tensors(f"checkpoints/step-{step:08d}")) == 1
    assert [e.step for e in acc.Tensors("final/val_loss")] == [6, 9]
    # The first session's board file: every record as before but the hparams one, in order.
    old, new = before[first_file.name], payloads(first_file)
    assert len(old) == len(new)
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    assert len(changed) == 1
    assert hp_metadata.SESSION_START_INFO_TAG.encode() in old[changed[0]]
    assert REPLACED_PREFIX.encode() in new[changed[0]]
    for name, records in before.items():  # nothing else of the first session changed
        if name != first_file.name:
            assert payloads(run / "tb" / name) == records
    assert 6 in event_steps(first_file)  # checkpoint links into this file still resolve
    assert not [p for p in (run / "tb").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_the_earlier_sessions_config_stays_readable_as_text(resumed):
    run, _, _ = resumed
    acc = accumulator(run / "tb")
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith(REPLACED_PREFIX)]
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "text"
    (event,) = acc.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert "| `trainer.epochs` | `2` | `3` |" in text
    assert "| `resume` | `null` | `latest` |" in text
    (changed,) = [line for line in text.splitlines() if line.startswith("Changed by")]
    names = set(changed.split(": ", 1)[1].split(", "))
    assert {"`resume`", "`resume_dir`", "`trainer.epochs`"} <= names
    assert "`model.hidden`" not in changed  # what stayed is listed after the changes only
    assert replace_earlier_hparams(run / "tb") == 1  # nothing left to replace


# ----------------------------------------------------------- event files built by hand
def hparams_event(epochs: int, wall_time: float) -> event_pb2.Event:
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=wall_time)
    info.hparams["trainer.epochs"].number_value = epochs
    data = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=info)
    value = summary_pb2.Summary.Value(
        tag=hp_metadata.SESSION_START_INFO_TAG,
        metadata=hp_metadata.create_summary_metadata(data),
        tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[b""]),
    )
    return event_pb2.Event(wall_time=wall_time, step=0, summary=summary_pb2.Summary(value=[value]))


def scalar_event(step: int, value: float) -> event_pb2.Event:
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[value])
    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="epoch/loss", tensor=tensor)]
    )
    summary.value[0].metadata.plugin_data.plugin_name = "scalars"
    return event_pb2.Event(wall_time=1_700_000_000 + step, step=step, summary=summary)


def write_events(path: Path, events) -> None:
    header = event_pb2.Event(wall_time=1_700_000_000, file_version="brain.Event:2")
    path.write_bytes(b"".join(frame(e.SerializeToString()) for e in [header, *events]))


LIVE_WRITER = """
import os, socket, sys
from pathlib import Path
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import metadata, plugin_data_pb2
from trainer.tensorboard.hparams import frame
info = plugin_data_pb2.SessionStartInfo(start_time_secs=1_700_000_000)
info.hparams["trainer.epochs"].number_value = 2
value = summary_pb2.Summary.Value(
    tag=metadata.SESSION_START_INFO_TAG,
    metadata=metadata.create_summary_metadata(
        plugin_data_pb2.HParamsPluginData(session_start_info=info)
    ),
)
events = [
    event_pb2.Event(wall_time=1_700_000_000, file_version="brain.Event:2"),
    event_pb2.Event(wall_time=1_700_000_000, summary=summary_pb2.Summary(value=[value])),
]
host, pid = socket.gethostname(), os.getpid()
path = Path(sys.argv[1]) / f"events.out.tfevents.1700000000.{host}.{pid}.0.v2"
path.write_bytes(b"".join(frame(e.SerializeToString()) for e in events))
print(path, flush=True)
sys.stdin.read()  # alive (a writer that may still append) until the test closes stdin
"""


def test_the_file_of_a_live_writer_is_never_rewritten(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", LIVE_WRITER, str(tmp_path)],
        env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        live = Path(child.stdout.readline().strip())
        assert live.is_file(), child.communicate(timeout=60)
        original = live.read_bytes()
        newer = tmp_path / "events.out.tfevents.1700000100.preempted-host.1.0.v2"
        write_events(newer, [hparams_event(3, 1_700_000_100)])
        assert replace_earlier_hparams(tmp_path) == 2
        assert live.read_bytes() == original  # its writer is alive: left alone
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert replace_earlier_hparams(tmp_path) == 2  # the writer is gone: replaced now
    assert live.read_bytes() != original
    assert start_info(tmp_path).hparams["trainer.epochs"].number_value == 3


# ------------------------------------------------------------------ killed midway
REWRITER = """
import resource, signal, sys
from trainer.tensorboard.hparams import replace_earlier_hparams
limit = int(sys.argv[2])
if limit:  # the kernel kills the process when the copy reaches `limit` bytes
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
print("ready", flush=True)
replace_earlier_hparams(sys.argv[1])
print("done", flush=True)
"""
SCALARS = 60_000  # ~3 MB: the copy takes long enough for a kill to land inside it


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    """A run's ``tb/`` after a preempted host's session (many scalars, then its hparams)
    and a newer session's hparams; plus the file as the rewrite must leave it."""
    import tensorflow as tf

    source = tmp_path_factory.mktemp("big") / "tb"
    source.mkdir()
    old = source / "events.out.tfevents.1700000000.preempted-host.4242.0.v2"
    with tf.io.TFRecordWriter(str(old)) as records:  # C++ framing: quick for many records
        records.write(
            event_pb2.Event(wall_time=1e9, file_version="brain.Event:2").SerializeToString()
        )
        for step in range(SCALARS):
            records.write(scalar_event(step, step / SCALARS).SerializeToString())
        records.write(hparams_event(2, 1_700_000_000).SerializeToString())
    newer = source / "events.out.tfevents.1700000100.preempted-host.4243.0.v2"
    write_events(newer, [hparams_event(3, 1_700_000_100)])
    expected = tmp_path_factory.mktemp("expected") / "tb"
    shutil.copytree(source, expected)
    assert replace_earlier_hparams(expected) == 2
    before, after = payloads(old), payloads(expected / old.name)  # CRCs checked
    assert len(before) == len(after) == SCALARS + 2
    assert before[:-1] == after[:-1]  # every scalar as it was
    assert REPLACED_PREFIX.encode() in after[-1] and REPLACED_PREFIX.encode() not in before[-1]
    return source, old.read_bytes(), (expected / old.name).read_bytes()


def rewrite_in_child(tb: Path, limit: int = 0, kill_after: float | None = None):
    env = subprocess_env()
    child = subprocess.Popen(
        [sys.executable, "-c", REWRITER, str(tb), str(limit)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout.readline().strip() == "ready"
    started = time.monotonic()
    if kill_after is not None:
        time.sleep(kill_after)
        child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=120)
    return child.returncode, time.monotonic() - started, err


def test_a_kill_midway_leaves_the_old_or_the_new_file(big_run, tmp_path):
    source, old, new = big_run
    name = "events.out.tfevents.1700000000.preempted-host.4242.0.v2"
    # The kernel kills the rewriter in the middle of copying (file size limit: SIGXFSZ).
    tb = tmp_path / "limited" / "tb"
    shutil.copytree(source, tb)
    code, _, err = rewrite_in_child(tb, limit=len(old) // 2)
    assert code == -signal.SIGXFSZ, err[-2000:]
    assert (tb / name).read_bytes() == old
    (partial,) = [p for p in tb.iterdir() if p.name.startswith(".")]
    assert "tfevents" not in partial.name  # TensorBoard never reads the half copy
    assert 0 < partial.stat().st_size <= len(old) // 2
    assert replace_earlier_hparams(tb) == 2  # the next session finishes the job
    assert (tb / name).read_bytes() == new and sorted(p.name[0] for p in tb.iterdir()) == ["e", "e"]

    # SIGKILL at random moments of a rewrite (durations measured on an unkilled one).
    tb = tmp_path / "timing" / "tb"
    shutil.copytree(source, tb)
    code, duration, err = rewrite_in_child(tb)
    assert code == 0 and (tb / name).read_bytes() == new, err[-2000:]
    rng = random.Random(15)
    for attempt in range(3):
        tb = tmp_path / f"kill{attempt}" / "tb"
        shutil.copytree(source, tb)
        rewrite_in_child(tb, kill_after=rng.uniform(0, duration))
        assert (tb / name).read_bytes() in (old, new)
        assert all("tfevents" not in p.name for p in tb.iterdir() if p.name.startswith("."))
        replace_earlier_hparams(tb)  # the next session finishes the job, if it is left
        assert (tb / name).read_bytes() == new
        assert not [p for p in tb.iterdir() if p.name.startswith(".")]


def test_a_resume_refused_by_a_callback_leaves_the_runs_hparams(compose_cfg):
    """EarlyStopping(restore_best_weights=True) refuses a resume (its best weights are not
    in checkpoints), but only at fit's start: the refused session had already replaced the
    run's HParams session (its trainer.epochs shown as the config that trained the run)."""
    from trainer import train
    from trainer.errors import ConfigError

    # The MLP saved as h5: what is checked is the run's event files, whatever the model.
    options = (
        "model=mlp",
        "save=h5",
        "callbacks=[early_stopping]",
        "callbacks.early_stopping.restore_best_weights=true",
    )
    cfg = compose_cfg(*options)
    train(cfg)
    tb = Path(cfg.run_dir) / "tb"
    before = {p.name: p.read_bytes() for p in tb.glob("*tfevents*")}
    assert start_info(tb).hparams["trainer.epochs"].number_value == 2
    with pytest.raises(ConfigError, match="restore_best_weights=True"):
        train(compose_cfg(*options, "trainer.epochs=3", "resume=auto"))
    assert start_info(tb).hparams["trainer.epochs"].number_value == 2
    assert all((tb / name).read_bytes() == data for name, data in before.items())
