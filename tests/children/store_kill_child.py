"""Child process for the kill tests of checkpoints on a store: SIGKILL itself in the middle
of a publication or of a retention delete, at a chosen object.

    python store_kill_child.py URL STAGING upload|delete|early

Two checkpoints are saved with the weights backend (retention keeps 1). ``upload``: the
second one's upload dies after its first object; ``delete``: retention's delete of the
first one dies right after the marker is gone (before any of its objects). ``early``: two
savedmodel checkpoints of a model with 12 MiB of variables; the second one's save dies in
its local write, once its variables' data file is on the store (uploaded early,
``trainer.storage.early``). The kill is injected by wrapping ``Store.put_files`` /
``Store.delete`` / ``SaveBackend.seal`` in this process only: the store has no crash
point of its own, and a kill at a random moment would rarely land there.
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

from trainer.checkpointing import CheckpointManager, CheckpointPolicy
from trainer.save_backends.base import SaveBackend
from trainer.storage.store import Store


def kill_after(method_name: str, when) -> None:
    """SIGKILL this process right after the first call of ``Store.<method_name>`` whose
    arguments ``when`` accepts."""
    real = getattr(Store, method_name)

    def wrapped(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        if when(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(Store, method_name, wrapped)


def kill_once_uploaded(url: str, key: str) -> None:
    """SIGKILL this process in the local write's last step (the manifest, before the
    fsync and the rename) once ``key`` is on the store; exit with 3 if it does not get
    there within two minutes (no upload during the local write)."""
    store = Store(url)

    def seal(self, tmp, known):
        deadline = time.monotonic() + 120
        while key not in store.walk(""):
            if time.monotonic() > deadline:
                print(f"{key} was not uploaded during the local write", flush=True)
                os._exit(3)
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    SaveBackend.seal = seal


def early(url: str, staging: str) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024)])
    model.compile("adam", "mse")
    x, y = np.ones((4, 1024), "float32"), np.zeros((4, 1024), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    policy = CheckpointPolicy(keep_last=1, async_save=False)
    manager = CheckpointManager(url, "savedmodel", policy, staging=staging)
    manager.save(model)
    model.fit(x, y, epochs=1, verbose=0)
    kill_once_uploaded(url, "step-00000002/variables/variables.data-00000-of-00001")
    manager.save(model)
    print("not killed", flush=True)


def main(url: str, staging: str, where: str) -> None:
    if where == "early":
        early(url, staging)
        return
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    x = np.ones((8, 3), "float32")
    policy = CheckpointPolicy(keep_last=1, async_save=False)
    manager = CheckpointManager(url, "weights", policy, staging=staging)
    manager.save(model)
    model.fit(x, np.zeros((8, 2), "float32"), epochs=1, verbose=0)
    if where == "upload":  # after the first object of the second checkpoint
        real = Store.put_files

        def first_then_kill(self, pairs):
            real(self, pairs[:1])
            os.kill(os.getpid(), signal.SIGKILL)

        Store.put_files = first_then_kill
    else:  # retention's delete of the first checkpoint, right after its marker went
        kill_after("delete", lambda keys: keys == [".commits/step-00000000.json"])
    manager.save(model)
    print("not killed", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
