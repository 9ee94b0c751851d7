"""Small real runs for the TensorBoard and export tests: a trained MLP on 8x8x1 synthetic
images, checkpoints saved through a RunBoard, laid out like a Hydra run directory."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import keras
import numpy as np
from omegaconf import OmegaConf

from tests.helpers import warm
from tests.helpers.processes import subprocess_env
from trainer.data import make_synthetic
from trainer.models import build_mlp
from trainer.save_backends import get_backend
from trainer.state import TrainingState
from trainer.tensorboard.board import RunBoard, config_hash, flatten_config

DATA = {
    "_target_": "trainer.data.make_synthetic",
    "num_examples": 64,
    "num_classes": 3,
    "validation_split": 0.25,
    "seed": 0,
}


def run_config(optimizer: str, learning_rate: float) -> dict:
    return {
        "seed": 0,
        "run_dir": None,
        "model": {"_target_": "trainer.models.build_mlp", "hidden": [16], "dropout": 0.0},
        "data": dict(DATA),
        "optimizer": {"name": optimizer, "learning_rate": learning_rate},
        "trainer": {"epochs": 2, "batch_size": 16, "tensorboard_dir": "tb"},
        "checkpoint": {"directory": "checkpoints"},
    }


def make_run(
    run_dir: Path, *, optimizer="adam", learning_rate=0.01, backends=("h5",), epochs=2
) -> dict:
    """Train ``epochs`` epochs, checkpoint after each through ``backends`` (cycled), write
    hparams and the graph; returns what the tests compare against."""
    keras.utils.set_random_seed(0)
    cfg = run_config(optimizer, learning_rate)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), run_dir / ".hydra" / "config.yaml")
    data = make_synthetic(**{k: v for k, v in DATA.items() if k != "_target_"})
    model = build_mlp((8, 8, 1), 3, hidden=(16,), dropout=0.0)
    opt = (
        keras.optimizers.Adam(learning_rate)
        if optimizer == "adam"
        else keras.optimizers.SGD(learning_rate)
    )
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    board = RunBoard(run_dir / "tb", run_dir=run_dir, config_hash=config_hash(cfg))
    board.write_graph(model)
    state = TrainingState(seed=0)
    saved = []
    for epoch in range(epochs):
        history = model.fit(data.x_train, data.y_train, batch_size=16, epochs=1, verbose=0)
        state.epoch = epoch + 1
        state.global_step += len(data.x_train) // 16
        state.metrics = {"loss": float(history.history["loss"][-1])}
        backend = get_backend(backends[epoch % len(backends)])
        path = board.save_checkpoint(
            backend,
            model,
            run_dir / "checkpoints" / f"epoch-{epoch + 1:03d}",
            state=state,
            metadata={"config": cfg},
        )
        saved.append(
            {
                "path": path,
                "step": state.global_step,
                "epoch": state.epoch,
                "metrics": dict(state.metrics),
                "backend": backend.name,
                "predictions": model.predict(data.x_val, verbose=0),
            }
        )
    final = {"val_loss": float(model.evaluate(data.x_val, data.y_val, verbose=0))}
    board.write_hparams(flatten_config(cfg), final, step=state.global_step)
    board.close()
    return {
        "run_dir": run_dir,
        "model": model,
        "data": data,
        "config": cfg,
        "checkpoints": saved,
        "final": final,
        "event_file": board.event_file,
        "config_hash": config_hash(cfg),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def tensorboard_server(logdir: Path, timeout: float = 600.0):
    """``tensorboard --logdir`` on a free loopback port; yields ``get(path, body=None)``
    returning parsed JSON. The server starts at once, warm where it can (its start-up,
    mostly importing TensorFlow when cold, overlaps whatever the test does next); the first
    ``get`` waits for it, for at most ``timeout`` seconds. The process is always killed."""
    port = free_port()
    command = [
        sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
        "--port", str(port), "--host", "127.0.0.1", "--load_fast", "false",
        "--reload_interval", "1",
    ]  # fmt: skip
    # Warm (tests.helpers.warm): TensorBoard imports TensorFlow too.
    process = warm.Popen(
        command, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    ready = False

    def fetch(path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(base + path, data=data)
        if body is not None:
            request.add_header("Content-Type", "application/json")
            request.add_header("X-XSRF-Protected", "1")
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read().decode())

    def get(path: str, body: dict | None = None):
        nonlocal ready
        while not ready:
            if process.poll() is not None:
                output = process.stdout.read().decode(errors="replace")
                raise RuntimeError(f"tensorboard exited with {process.returncode}: {output}")
            try:
                fetch("/data/runs")
                ready = True
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"no answer on {base} in {timeout}s") from None
                time.sleep(0.25)
        return fetch(path, body)

    try:
        yield get
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


def wait_for(get, path: str, ready, body: dict | None = None, timeout: float = 600.0):
    """Poll ``path`` until ``ready(answer)``: TensorBoard loads event files in the
    background after it starts answering. ``timeout`` only stops a hang: it is far above
    what a busy machine needs, so no result depends on speed."""
    deadline = time.monotonic() + timeout
    while True:
        answer = get(path, body)
        if ready(answer) or time.monotonic() > deadline:
            return answer
        time.sleep(0.25)


def assert_close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
