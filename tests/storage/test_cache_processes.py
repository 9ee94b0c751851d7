"""Two processes loading the same checkpoint of a store at the same time, with an empty
local cache (``trainer.storage.cache``): the first to claim the entry downloads it in
place while the other waits for the claim to go; both load the same model, and the cache
ends with one complete entry and no claim or temporary left. Against a real S3-compatible
server on 127.0.0.1 (``tests/helpers/s3_server``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np

from tests.children.store_load_child import inputs
from tests.helpers.paths import ROOT
from tests.helpers.processes import subprocess_env
from trainer.checkpointing import CheckpointManager
from trainer.state import TrainingState
from trainer.storage import integrity

CHILD = ROOT / "tests" / "children" / "store_load_child.py"
HANG_GUARD = 300  # seconds; only against a hung child, never asserted as a duration
WIDTH = 600  # a 1.4 MB variables file: above integrity.DEFER_FROM, so it arrives late


def _start_together(url: str, tmp_path: Path, count: int) -> list[subprocess.Popen]:
    """``count`` children loading ``url``, released at once when all are ready to load."""
    go = tmp_path / "go"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                url,
                str(tmp_path / f"ready-{i}"),
                str(go),
                str(tmp_path / f"out-{i}.npy"),
            ],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    deadline = time.monotonic() + HANG_GUARD
    while not all((tmp_path / f"ready-{i}").exists() for i in range(count)):
        failed = [c for c in children if c.poll() is not None]
        assert not failed, failed[0].communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the children never got ready"
        time.sleep(0.05)
    go.touch()
    return children


def test_two_processes_loading_one_checkpoint_share_one_cache_entry(s3_bucket, tmp_path):
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [keras.Input((WIDTH,)), keras.layers.Dense(WIDTH), keras.layers.Dense(3)]
    )
    model.compile("sgd", "mse")
    url = f"{s3_bucket}/run/checkpoints"
    with CheckpointManager(url, "savedmodel", staging=tmp_path / "staging") as manager:
        manager.save(model, TrainingState(global_step=1), wait=True)
    assert WIDTH * WIDTH * 4 >= integrity.DEFER_FROM
    cache = Path(os.environ["TRAINER_STORE_CACHE"])
    assert not cache.exists() or not any(cache.iterdir())  # empty: both must download

    children = _start_together(f"{url}/latest", tmp_path, 2)
    for child in children:
        _, err = child.communicate(timeout=HANG_GUARD)
        assert child.returncode == 0, err[-3000:]

    first, second = (np.load(tmp_path / f"out-{i}.npy") for i in range(2))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, model.predict(inputs(WIDTH), verbose=0), rtol=1e-5)
    left = sorted(p.name for p in cache.iterdir())
    assert len(left) == 1 and not left[0].startswith("."), left  # one entry, no claim/temp
    entry = cache / left[0]
    assert sorted(p.name for p in entry.iterdir()) == ["step-00000001"]
    assert integrity.total_size(entry) > WIDTH * WIDTH * 4
