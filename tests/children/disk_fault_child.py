"""Child process for the disk-fault tests: a real file-size limit (``RLIMIT_FSIZE``, with
SIGXFSZ ignored so writes fail with EFBIG the way a full disk fails them with ENOSPC).

    python disk_fault_child.py backends OUT_DIR
    python disk_fault_child.py train OUT_DIR LIMIT_BYTES NAME=BACKEND:ON_SAVE_ERROR...

Prints one JSON line (the last line of stdout) describing what happened.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # tests/children/disk_fault_child.py
UNLIMITED = resource.RLIM_INFINITY


def limit_file_size(limit: int | None) -> None:
    """Lower (or lift) only the soft limit, so it can be lifted again afterwards."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (UNLIMITED if limit is None else limit, hard))


class LimitFileSize(keras.callbacks.Callback):
    """From global batch ``step`` on, no file may grow beyond ``limit`` bytes."""

    def __init__(self, step: int, limit: int):
        super().__init__()
        self.step, self.limit, self.seen = step, limit, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            limit_file_size(self.limit)


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def largest_file(path: Path) -> int:
    """The largest file a save wrote into ``path``: a file hard-linked from an earlier
    checkpoint (a repeat savedmodel save links the unchanged ``saved_model.pb``) takes no
    new space, so a size limit below it would not make the save fail."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return max(p.stat().st_size for p in files if p.stat().st_nlink == 1)


def backends(out: Path) -> list[dict]:
    """Every backend: a good save, then saves under shrinking limits; each must fail
    cleanly and leave the good checkpoint verifiable."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.fault_corpus import build_model
    from trainer.errors import TrainerError
    from trainer.save_backends import get_backend, load_checkpoint
    from trainer.save_backends.savedmodel import SavedModelBackend

    model = build_model()
    x = np.ones((2, 6), "float32")
    expected = np.asarray(model(x))
    cases = {
        "h5": get_backend("h5"),
        "weights": get_backend("weights"),
        "savedmodel": SavedModelBackend(),  # second save reuses the trace: TF writes variables
        "savedmodel-full": SavedModelBackend(reuse_traces=False),  # tf.saved_model.save
    }
    records = []
    for name, backend in cases.items():
        directory = out / name
        good = backend.save(model, directory / "good")
        size = largest_file(backend.save(model, directory / "repeat"))  # as the next writes
        for fraction in (0.0, 0.3, 0.7, 0.97):
            before = listing(directory)
            limit_file_size(int(size * fraction))
            try:
                backend.save(model, directory / "next")
                error = None
            except TrainerError as caught:
                error = {"type": type(caught).__name__, "message": str(caught)[:400]}
            except Exception as caught:  # recorded, and the test fails on it
                error = {"type": f"raw {type(caught).__name__}", "message": str(caught)[:400]}
            finally:
                limit_file_size(None)
            loaded = load_checkpoint(good, verify=True).model
            records.append(
                {
                    "backend": name,
                    "limit": int(size * fraction),
                    "largest_file": size,
                    "error": error,
                    "before": before,
                    "after": listing(directory),
                    "previous_intact": bool(np.array_equal(np.asarray(loaded(x)), expected)),
                }
            )
    return records


def full_disk_run(out: Path, on_save_error: str, limit: int) -> list[str]:
    """Overrides of a small run whose files may not grow past ``limit`` bytes from step 5
    (also used by tensorboard_fault_child.py)."""
    return [
        "model=mlp",
        "model.hidden=[256,256]",
        "data=synthetic",
        "trainer.epochs=3",
        "trainer.steps_per_epoch=4",
        "trainer.batch_size=16",
        "trainer.verbose=0",
        "export.enabled=false",
        "checkpoint.policy.keep_last=null",
        f"checkpoint.policy.on_save_error={on_save_error}",
        f"run_dir={out}",
        f"+callbacks.fsize={{_target_: disk_fault_child.LimitFileSize, step: 5, limit: {limit}}}",
    ]


def train_run(out: Path, backend: str, on_save_error: str, limit: int) -> dict:
    from hydra import compose, initialize_config_dir

    import trainer.training.config  # noqa: F401  (the schemas conf/ extends)
    from trainer.errors import SaveError
    from trainer.save_backends import load_checkpoint
    from trainer.training.loop import train

    overrides = [
        f"save={backend}",
        "checkpoint.policy.every_n_steps=1",
        *full_disk_run(out, on_save_error, limit),
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=overrides)
    try:
        train(cfg)
        outcome = {"finished": True}
    except SaveError as error:
        outcome = {"finished": False, "error": type(error).__name__, "message": str(error)[:400]}
    limit_file_size(None)
    checkpoints = out / "checkpoints"
    names = [n for n in listing(checkpoints) if n != "latest"]
    steps = {}
    for name in names:
        if not name.startswith("."):
            steps[name] = load_checkpoint(checkpoints / name, verify=True).state.global_step
    latest = load_checkpoint(checkpoints / "latest", verify=True)
    return {
        **outcome,
        "checkpoints": steps,
        "temporaries": [n for n in names if n.startswith(".")],
        "latest_step": latest.state.global_step,
    }


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "backends":
        result = backends(out)
    else:  # CASE=BACKEND:ON_SAVE_ERROR ... one after the other (one TensorFlow start-up)
        limit = int(sys.argv[3])
        result = {}
        for case in sys.argv[4:]:
            name, _, spec = case.partition("=")
            backend, _, on_save_error = spec.partition(":")
            result[name] = train_run(out / name, backend, on_save_error, limit)
    print(json.dumps(result))
