"""One HParams session per run, showing the config of the run's latest training session.

Why: TensorBoard's HParams plugin reads a run's config from the summary *metadata* of the
tag ``_hparams_/session_start_info``, and for one run (one log directory) the first
metadata it reads wins; it reads the directory's event files in name order, oldest first.
So when a resumed session (``resume=latest trainer.epochs=<more>``) wrote its own hparams
into the run's ``tb/``, the tab kept showing the first session's config.

What we do: every session that trains writes its hparams into its own event file, then
``replace_earlier_hparams`` rewrites each older event file of the run that still holds a
``session_start_info``: that one value becomes a text summary ``hparams/replaced/<start>``
(same step and wall time) holding the earlier session's hparams as a table; every other
record is copied byte for byte. The run thus keeps exactly one session for the HParams tab,
the newest one, in the same log directory as its curves, cards and ``final/*`` metrics, so
they stay linked to it; earlier configs stay readable in the Text tab (and in full in
``<run>/.hydra/sessions/<n>/config.yaml``).

Rejected alternatives: one hparams run per session (``tb/session-<n>/``): the plugin links
metrics to a session by run name, so the curves in ``tb/`` would belong to no config and a
multirun's comparison would list stale rows; making the newest file sort first is not
possible, TensorFlow's writers name files by creation time.

Crash safety: a file is rewritten into a hidden temporary sibling whose name holds no
``tfevents`` (TensorBoard never reads it), fsynced, renamed over the original and the
directory fsynced, so a SIGKILL at any moment leaves the old or the new file; temporaries
of dead processes are removed by the next call. Never rewritten: a file this process has
open (the current session's writers), a file whose name records another live process on
this host (its writer may still append), a file that changed while it was being copied.
Files of other hosts (a run continued after its machine was preempted) are rewritten: the
run-directory lock (``trainer.storage.locks``) that training holds keeps other trainers out.
A TensorBoard already running keeps what it read; it shows the new config after a restart.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import mmap
import os
import re
import shutil
import socket
import struct
import uuid
from collections.abc import Iterable
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
from tensorboard.plugins.hparams import metadata as hp_metadata
from tensorboard.plugins.text import metadata as text_metadata

from trainer.storage.atomic import TMP_MARKER, fsync_path, process_alive, remove_path

log = logging.getLogger(__name__)

HPARAMS_TAG = hp_metadata.SESSION_START_INFO_TAG
REPLACED_PREFIX = "hparams/replaced/"  # text tag of an earlier session's hparams
REWRITE_PREFIX = ".hparams-rewrite"  # temporaries: hidden, and no "tfevents" in the name
EVENT_FILE = re.compile(r"^events\.out\.tfevents\.\d+\.(?P<rest>.+)$")
_HEADER = 12  # TFRecord: uint64 length, uint32 masked CRC of the length
_FOOTER = 4  # uint32 masked CRC of the data


@dataclasses.dataclass
class EventFile:
    """An event file split into its framed TFRecords (bytes as on disk) and a tail that
    is no complete record (a writer killed mid-record): both copied as they are."""

    path: Path
    records: list[bytes]
    tail: bytes
    size: int
    hparams: dict[int, event_pb2.Event]  # record index -> event holding a session_start_info


def replace_earlier_hparams(log_dir: str | os.PathLike) -> int:
    """Keep only the newest ``session_start_info`` (by wall time) of the run in ``log_dir``;
    each older one becomes a text summary (module docstring). Returns how many the run
    held (0: none, so the HParams tab lists no session for it)."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        return 0
    clean_stale_rewrites(log_dir)
    files = [read_event_file(p) for p in event_files(log_dir)]
    found = [(event.wall_time, f.path.name, i, f) for f in files for i, event in f.hparams.items()]
    if not found:
        return 0
    newest = max(found, key=lambda item: item[:3])
    kept = newest[3].hparams[newest[2]]
    for current in files:
        earlier = {i: e for i, e in current.hparams.items() if e is not kept}
        if earlier and rewritable(current.path):
            rewrite(current, {i: replaced_event(e, kept) for i, e in earlier.items()})
    return len(found)


def event_files(log_dir: Path) -> list[Path]:
    """The event files TensorBoard reads as this run (the directory's own files)."""
    return sorted(
        p for p in log_dir.iterdir() if "tfevents" in p.name and p.is_file() and not p.is_symlink()
    )


def read_event_file(path: Path) -> EventFile:
    """Split ``path`` into framed records without checking CRCs (they are copied, never
    re-framed); parse only the records that can hold a ``session_start_info``. A file
    without one (most: the scalars) is only searched, never loaded."""
    needle = HPARAMS_TAG.encode()
    if not _contains(path, needle):
        return EventFile(path, [], b"", path.stat().st_size, {})
    blob = path.read_bytes()
    records, position = [], 0
    while len(blob) - position >= _HEADER:
        (length,) = struct.unpack_from("<Q", blob, position)
        end = position + _HEADER + length + _FOOTER
        if end > len(blob):
            break
        records.append(blob[position:end])
        position = end
    hparams = {}
    for index, record in enumerate(records):
        if needle not in record:
            continue
        try:
            event = event_pb2.Event.FromString(record[_HEADER:-_FOOTER])
        except Exception:  # a corrupt record is copied as it is, not read
            continue
        if any(value.tag == HPARAMS_TAG for value in event.summary.value):
            hparams[index] = event
    return EventFile(path, records, blob[position:], len(blob), hparams)


def _contains(path: Path, needle: bytes) -> bool:
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return False
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return mapped.find(needle) >= 0


def rewritable(path: Path) -> bool:
    """Whether no live writer may still append to ``path`` (module docstring)."""
    if _open_in_this_process(path):
        return False
    owner = writer_pid(path.name)
    if owner is not None and owner != os.getpid() and process_alive(owner):
        log.info("Not rewriting %s: its writer (PID %d) is still running", path, owner)
        return False
    return True


def writer_pid(name: str) -> int | None:
    """The PID in an event file name written on this host
    (``events.out.tfevents.<time>.<host>.<pid>.<n><suffix>``), else None."""
    match = EVENT_FILE.match(name)
    host = socket.gethostname()
    if not match or not match.group("rest").startswith(host + "."):
        return None
    pid = match.group("rest")[len(host) + 1 :].split(".", 1)[0]
    return int(pid) if pid.isdigit() else None


def _open_in_this_process(path: Path) -> bool:
    """Whether a file descriptor of this process points at ``path`` (Linux ``/proc``;
    elsewhere False: the caller's own writers are then excluded by the PID in the name
    only for other processes)."""
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        return False
    target = os.fspath(path.resolve())
    for fd in list(fd_dir.iterdir()):
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:  # closed while we looked
            continue
    return False


def rewrite(current: EventFile, replacements: dict[int, event_pb2.Event]) -> None:
    """Replace ``current.path`` by its records with ``replacements``: temporary sibling,
    fsync, rename, fsync of the directory. Nothing happens if the file changed since it was
    read (a writer appended after all): no record of it may be lost."""
    path = current.path
    tmp = path.with_name(f"{REWRITE_PREFIX}{TMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as out:
            for index, record in enumerate(current.records):
                event = replacements.get(index)
                out.write(record if event is None else frame(event.SerializeToString()))
            out.write(current.tail)
            out.flush()
            os.fsync(out.fileno())
        shutil.copymode(path, tmp)
        if path.stat().st_size != current.size:
            log.warning("Not rewriting %s: it grew while it was copied", path)
            remove_path(tmp)
            return
        os.replace(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise
    fsync_path(path.parent)
    log.info("HParams of an earlier session in %s kept as text (%s*)", path, REPLACED_PREFIX)


def clean_stale_rewrites(log_dir: Path) -> None:
    """Remove rewrite temporaries whose process is gone (killed mid-rewrite)."""
    for child in log_dir.glob(f"{REWRITE_PREFIX}{TMP_MARKER}*"):
        pid = child.name[len(REWRITE_PREFIX) + len(TMP_MARKER) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid)):
            continue
        remove_path(child)


def replaced_event(event: event_pb2.Event, kept: event_pb2.Event) -> event_pb2.Event:
    """``event`` with its ``session_start_info`` as a text summary (same step, time)."""
    new = event_pb2.Event()
    new.CopyFrom(event)
    del new.summary.value[:]
    for value in event.summary.value:
        if value.tag == HPARAMS_TAG:
            value = replaced_value(value, kept, event.wall_time)
        new.summary.value.append(value)
    return new


def replaced_value(value: summary_pb2.Summary.Value, kept: event_pb2.Event, wall_time: float):
    """The text summary of an earlier session's ``session_start_info`` value, tagged with
    the time the session started (its own, else the event's)."""
    info = session_info(value)
    newer = session_info(next(v for v in kept.summary.value if v.tag == HPARAMS_TAG))
    start = info.start_time_secs or wall_time
    started = _utc(start)
    text = hparams_markdown(
        hparams_of(info), hparams_of(newer), started, _utc(newer.start_time_secs or kept.wall_time)
    )
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
    meta = text_metadata.create_summary_metadata(
        display_name=f"hparams of the session started {started}",
        description="An earlier session's hparams, replaced in the HParams tab by a later one.",
    )
    tag = REPLACED_PREFIX + _utc(start, "%Y-%m-%dT%H-%M-%SZ")
    return summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)


def session_info(value: summary_pb2.Summary.Value):
    return hp_metadata.parse_session_start_info_plugin_data(value.metadata.plugin_data.content)


def hparams_of(info) -> dict[str, object]:
    """``{name: value}`` of a ``SessionStartInfo`` (bool, number or string values)."""
    values = {}
    for name, value in info.hparams.items():
        kind = value.WhichOneof("kind")
        values[name] = getattr(value, kind) if kind else None
    return values


def hparams_markdown(
    earlier: dict[str, object], newer: dict[str, object], started: str, replaced_by: str
) -> str:
    """A table of ``earlier``, led by the keys whose value the newer session changed."""
    changed = sorted(k for k in set(earlier) | set(newer) if earlier.get(k) != newer.get(k))
    lines = [
        f"**HParams of the session started {started}**, replaced in the HParams tab by "
        f"those of the session started {replaced_by}. Every session's full config: "
        "`.hydra/sessions/<n>/config.yaml` in the run directory.",
        "",
    ]
    if changed:
        lines += ["Changed by the newer session: " + ", ".join(f"`{k}`" for k in changed), ""]
    lines += ["| hparam | this session | the newer session |", "|---|---|---|"]
    for key in [*changed, *sorted(set(earlier) - set(changed))]:
        lines.append(f"| `{key}` | {_show(earlier.get(key))} | {_show(newer.get(key))} |")
    return "\n".join(lines)


def frame(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC-32C of the length, data, masked CRC-32C of it."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def masked_crc32c(data: Iterable[int]) -> int:
    """CRC-32C (Castagnoli), masked as TFRecord framing stores it. Pure Python: only the
    few replaced records are framed anew, everything else is copied."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _show(value: object) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # HParams store every number as a double
    return f"`{value}`"


def _utc(seconds: float, form: str = "%Y-%m-%d %H:%M:%S UTC") -> str:
    return datetime.datetime.fromtimestamp(float(seconds), tz=datetime.UTC).strftime(form)
