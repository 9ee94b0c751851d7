"""Save and load through object storage against a plain s3fs transfer of the same bytes.

``python -m benchmarks.store_cost --sizes small,large --repeats 3`` starts moto's S3 server
on 127.0.0.1 (as the tests do, ``tests/helpers/s3_server``), points trainer at it through
the standard environment (``AWS_ENDPOINT_URL`` and the keys) and, for each size and
backend, times side by side in one process:

- ``save``: ``CheckpointManager(s3://...).save(model, wait=True)`` whole (lease renewal,
  the backend's local write, the upload, the commit marker, ``latest``; ``keep_last=1``,
  so from the second repeat on the previous checkpoint is deleted too, as in training);
- ``floor up``: s3fs ``put`` of the same local checkpoint's files to a fresh prefix (one
  call, recursive: s3fs's own concurrency), what a user doing it by hand would pay;
- ``load``: ``load_checkpoint(s3://.../<name>)`` with an empty local cache (download,
  check against the marker, the backend's load);
- ``floor down``: s3fs ``get`` of the same objects into a fresh local directory.

The floors run right before or after ours, alternating, each repeat. The issue's target
(40) is save <= 1.5x floor up and load <= 1.5x floor down, for the large model. Also shown:
the local write alone and the load from the local copy alone (what is not transfer).
``--server process`` runs moto in a process of its own: the default thread shares this
process's interpreter lock with the client and the backend, which no real store does.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import models, specs

BACKENDS = ("savedmodel", "h5", "weights")
TARGET = 1.5
# Each timed operation of ours and the floor it is compared with.
FLOORS = {"save": "floor_up", "publish": "floor_up", "load": "floor_down", "fetch": "floor_down"}


class _ProcessServer:
    """moto's server in a process of its own (``--server process``): it does not share
    this process's interpreter lock, as a real store (another machine) does not."""

    def __init__(self):
        import socket
        import subprocess
        import sys

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto's server did not start")

    def get_host_and_port(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def start_server(kind: str = "thread") -> tuple[object, str]:
    """moto's S3 server on a free port of 127.0.0.1, threaded in this process or in its
    own (``kind="process"``); the environment points at it (the product reads only that)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if kind == "process":
        server = _ProcessServer()
    else:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return server, endpoint


def _timed(call) -> float:
    gc.collect()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(size_name: str, backend: str, repeats: int, scratch: Path, bucket: str) -> dict:
    """Every timing of one size and backend, ``repeats`` each, ours and the floors
    alternating which goes first."""
    from trainer.checkpointing import CheckpointManager, CheckpointPolicy
    from trainer.state import TrainingState

    size = specs.SIZES[size_name]
    model = models.build(size, seed=0)
    url = f"s3://{bucket}/{size_name}-{backend}"
    times: dict[str, list[float]] = {key: [] for key in ROWS}
    staging = scratch / f"staging-{size_name}-{backend}"
    policy = CheckpointPolicy(keep_last=1, async_save=False)
    with CheckpointManager(url, backend, policy, staging=staging) as manager:
        manager.save(model, TrainingState(global_step=1), wait=True)  # traces, takes the lease
        for index in range(repeats):
            models.train_step(model, size, seed=10 + index)
            state = TrainingState(global_step=2 + index)
            for key, seconds in _repeat(manager, model, state, index, scratch, bucket).items():
                times[key].append(seconds)
    return {"size": size_name, "backend": backend, "bytes": _staged_bytes(staging), "times": times}


def _repeat(manager, model, state, index: int, scratch: Path, bucket: str) -> dict[str, float]:
    """One repeat of every row; ours first on even repeats, the floors first on odd."""
    from trainer.checkpointing.wrappers import innermost
    from trainer.save_backends import get_backend, load_checkpoint
    from trainer.storage.remote import RemoteCheckpoints
    from trainer.storage.store import filesystem

    fs = filesystem("s3")
    url = manager.remote.url
    staging = manager.directory
    got: dict[str, float] = {}
    loaded = []

    def load() -> None:
        loaded.append(load_checkpoint(f"{url}/latest"))

    order = (1, 0) if index % 2 == 0 else (0, 1)
    for ours in order:
        if ours:
            got["save"] = _timed(lambda: manager.save(model, state, wait=True))
        else:
            got["floor_up"] = _floor_up(fs, staging, bucket)
    for ours in order:
        os.environ["TRAINER_STORE_CACHE"] = os.fspath(scratch / f"cache-{index}-{ours}")
        if ours:
            got["load"] = _timed(load)
        else:
            got["floor_down"] = _floor_down(fs, url, scratch)
    (staged,) = [p for p in staging.iterdir() if not p.name.startswith(".")]
    other = RemoteCheckpoints(f"{url}-publish")
    got["publish"] = _timed(lambda: other.publish(staged, step=state.global_step))
    # An empty cache of its own: the load's entry holds the same objects (same content key).
    os.environ["TRAINER_STORE_CACHE"] = os.fspath(scratch / f"cache-{index}-2")
    got["fetch"] = _timed(lambda: other.fetch(staged.name))
    other.delete(staged.name)
    got["local_load"] = _timed(lambda: load_checkpoint(loaded[-1].path))
    for which in (0, 1, 2):
        shutil.rmtree(scratch / f"cache-{index}-{which}", ignore_errors=True)
    writer = get_backend(innermost(manager.backend).name)
    target = Path(writer.checkpoint_path(scratch / f"local-{index}"))
    got["local_write"] = _timed(lambda: writer.save(model, target))
    _remove(target)
    return got


ROWS = {
    "save": "ours: CheckpointManager.save to s3:// (wait=True)",
    "floor_up": "floor: s3fs put of the same files",
    "publish": "ours, the upload alone: RemoteCheckpoints.publish of the staged copy",
    "load": "ours: load_checkpoint(s3://.../latest), empty cache",
    "floor_down": "floor: s3fs get of the same objects",
    "fetch": "ours, the download alone: RemoteCheckpoints.fetch, empty cache",
    "local_write": "local write alone (backend.save to disk)",
    "local_load": "load of the local copy alone",
}


def _staged(staging: Path) -> list[Path]:
    """The files of the checkpoint staged locally (the one ``keep_last=1`` kept)."""
    (checkpoint,) = [p for p in staging.iterdir() if not p.name.startswith(".")]
    if checkpoint.is_file():
        return [checkpoint]
    return sorted(p for p in checkpoint.rglob("*") if p.is_file())


def _staged_bytes(staging: Path) -> int:
    return sum(p.stat().st_size for p in _staged(staging))


def _floor_up(fs, staging: Path, bucket: str) -> float:
    """s3fs ``put`` of the staged checkpoint's files to a fresh prefix: one call, as a user
    would copy a directory (s3fs uploads the files concurrently)."""
    files = _staged(staging)
    prefix = f"{bucket}/floor-{uuid.uuid4().hex[:8]}"
    targets = [f"{prefix}/{p.relative_to(staging).as_posix()}" for p in files]
    seconds = _timed(lambda: fs.put([os.fspath(p) for p in files], targets))
    fs.rm(prefix, recursive=True)
    return seconds


def _floor_down(fs, url: str, scratch: Path) -> float:
    """s3fs ``get`` of the objects of the store's newest checkpoint (the same bytes
    ``load`` downloads) into a fresh local directory."""
    from trainer.storage.remote import RemoteCheckpoints

    remote = RemoteCheckpoints(url)
    name, marker = remote.resolve("latest")
    keys = [remote.store.key(f"{name}/{e['path']}") for e in marker["objects"]]
    if marker["kind"] == "file":
        keys = [remote.store.key(name)]
    down = scratch / f"down-{uuid.uuid4().hex[:8]}"
    locals_ = [os.fspath(down / str(i)) for i in range(len(keys))]
    down.mkdir()
    seconds = _timed(lambda: fs.get(keys, locals_))
    shutil.rmtree(down, ignore_errors=True)
    return seconds


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def report(results: list[dict], command: str) -> list[str]:
    """Markdown tables: every row's median (min, max), and the targets' ratios."""
    lines = [f"Command: `{command}`", ""]
    lines += ["| size | backend | bytes | operation | median s | min s | max s | vs floor |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for result in results:
        times = result["times"]
        for key, label in ROWS.items():
            values = times[key]
            if not values:
                continue
            floor = FLOORS.get(key)
            ratio = (
                f"{statistics.median(values) / statistics.median(times[floor]):.2f}x"
                if floor
                else ""
            )
            lines.append(
                f"| {result['size']} | {result['backend']} | {result['bytes']:,} | {label} | "
                f"{statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} | "
                f"{ratio} |"
            )
    lines += ["", f"| target (issue 40, <= {TARGET}x) | backend | ratio | verdict |"]
    lines += ["|---|---|---|---|"]
    for result in results:
        if result["size"] != "large":
            continue
        for op, floor in FLOORS.items():
            ratio = statistics.median(result["times"][op]) / statistics.median(
                result["times"][floor]
            )
            verdict = "met" if ratio <= TARGET else "missed"
            lines.append(f"| large {op} | {result['backend']} | {ratio:.2f}x | {verdict} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the raw timings here")
    parser.add_argument(
        "--server",
        choices=("thread", "process"),
        default="thread",
        help="moto in this process (shares its interpreter lock) or in its own",
    )
    args = parser.parse_args(argv)
    import json
    import sys

    server, _endpoint = start_server(args.server)
    scratch = Path(tempfile.mkdtemp(prefix="trainer-storecost-"))
    saved_env = os.environ.get("TRAINER_STORE_CACHE")
    try:
        from trainer.storage.store import filesystem

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        filesystem("s3").mkdir(bucket)
        results = [
            measure(size, backend, args.repeats, scratch, bucket)
            for size in args.sizes.split(",")
            for backend in args.backends.split(",")
        ]
    finally:
        if saved_env is None:
            os.environ.pop("TRAINER_STORE_CACHE", None)
        else:
            os.environ["TRAINER_STORE_CACHE"] = saved_env
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()
    command = "python -m benchmarks.store_cost " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    print("\n".join(report(results, command.strip())))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
