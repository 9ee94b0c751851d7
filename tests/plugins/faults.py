"""Fault injection for tests and drills: real signals and slow writes, selected from config.

Test-only: this lives outside the ``trainer`` package, on the path of the test process and
of its children (``tests/plugins``, see ``tests.helpers.paths.PLUGINS_DIR`` and
``subprocess_env``).
Runs select it through the product's generic hooks:

    +callbacks.sigterm={_target_: faults.SignalAtStep, step: 4}
    save._target_=faults.slow_backend +save.inner=weights +save.delay=0.3
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import keras

from trainer.save_backends.base import SaveBackend
from trainer.save_backends.registry import backend_class
from trainer.state import TrainingState


class SignalAtStep(keras.callbacks.Callback):
    """Sends ``signum`` to this very process once the global batch count reaches ``step``."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM)):
        super().__init__()
        self.step = step
        self.signum = signum
        self.seen = 0

    def on_train_begin(self, logs=None):
        self.seen = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            os.kill(os.getpid(), self.signum)


class SignalInValidation(keras.callbacks.Callback):
    """Sends ``signum`` to this very process when the validation of epoch ``epoch``
    (0-based) starts: after that epoch's last training batch, before its end."""

    def __init__(self, epoch: int, signum: int = int(signal.SIGTERM)):
        super().__init__()
        self.epoch = epoch
        self.signum = signum
        self.current = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_test_begin(self, logs=None):
        if self.current == self.epoch:
            os.kill(os.getpid(), self.signum)


def slow_backend(inner: str = "weights", delay: float = 0.5, **options: Any) -> SaveBackend:
    """The registered backend ``inner``, sleeping ``delay`` seconds inside every write.

    The sleep happens after the files are written into the temporary sibling and before the
    rename, which widens the window in which a crash leaves a partial checkpoint behind.
    """
    base = backend_class(inner)

    class Slow(base):  # type: ignore[valid-type, misc]
        def _write(
            self, model: keras.Model, tmp: Path, state: TrainingState, metadata: dict[str, Any]
        ) -> None:
            super()._write(model, tmp, state, metadata)
            time.sleep(delay)

    Slow.__name__ = Slow.__qualname__ = f"Slow{base.__name__}"
    return Slow(**options)


class PoisonAtEpoch(keras.callbacks.Callback):
    """Makes one weight NaN when epoch ``epoch`` (0-based) begins: training diverges there
    as it would with a learning rate far too high, at a known point."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            kernel = self.model.trainable_variables[0]
            kernel.assign(kernel * float("nan"))
