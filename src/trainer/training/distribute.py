"""tf.distribute for ``train``: building the strategy (``conf/strategy``), who is chief, the
batch-size and learning-rate rule, and where each worker writes.

Rules (also in docs/how-to/multi-worker.md):

* ``trainer.batch_size`` is the **global** batch: every optimizer step consumes that many
  examples, split evenly over ``num_replicas`` (each replica sees ``batch_size /
  num_replicas``). Keras scales each replica's loss by ``1 / num_replicas`` and the
  gradients are summed across replicas, so a step is the same step as on one device (up
  to floating-point reduction order) and the data order, step counts and resume points do
  not depend on the strategy.
* The learning rate is used as configured. ``strategy.scale_lr=true`` multiplies it by
  ``num_replicas`` (the linear scaling rule), for when you also multiplied the batch size.
* Only the chief writes into the run directory. Every other worker runs the very same
  code (saves, events, exports), so it joins every collective those need, but into a
  hidden scratch directory ``<run>/.worker-<id>.tmp-*`` whose checkpoints are removed after
  each save and which is removed when training ends (TensorFlow's multi-worker convention).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf
from omegaconf import DictConfig, OmegaConf

from trainer._compat import keras_bugs
from trainer.checkpointing.wrappers import WrappingBackend
from trainer.errors import ConfigError
from trainer.save_backends.base import SaveBackend
from trainer.storage.atomic import remove_path
from trainer.storage.locks import DirectoryLock
from trainer.training import interrupts

log = logging.getLogger(__name__)

KINDS = ("default", "mirrored", "multiworker")
_CACHE: dict[str, tf.distribute.Strategy] = {}  # one strategy per process and config


class DistributeError(ConfigError):
    """The strategy cannot be built as configured (a config error: exit 2, before training)."""


@dataclasses.dataclass
class Distribution:
    """The strategy of this process (None = default, one device) and its role."""

    strategy: tf.distribute.Strategy | None = None
    kind: str = "default"
    task_type: str | None = None
    task_id: int = 0
    scale_lr: bool = False
    scratch: Path | None = None
    lock: DirectoryLock | None = None  # the chief's hold on the run directory
    agreement: AgreeOnStop | None = None  # multi-worker: the stop agreement of the session

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync if self.strategy is not None else 1

    @property
    def is_chief(self) -> bool:
        return is_chief(self.task_type, self.task_id)

    @property
    def lr_factor(self) -> float:
        return float(self.num_replicas) if self.scale_lr else 1.0

    def scope(self) -> contextlib.AbstractContextManager:
        """Build model, optimizer and metrics in here, so their variables are distributed."""
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def per_replica_batch(self, global_batch: int) -> int:
        if global_batch % self.num_replicas:
            log.warning(
                "trainer.batch_size=%d does not divide over %d replicas; batches are split "
                "unevenly and a step is no longer exactly the single-device step",
                global_batch,
                self.num_replicas,
            )
        return max(1, global_batch // self.num_replicas)

    def prepare_model(self, model: Any, example_batch: tuple) -> None:
        """Work around Keras 3.15 under a strategy with more than one replica: before every
        fit/evaluate, Keras takes a batch from the distributed iterator and all-reduces it
        (nested) only to read its shapes. MultiWorkerMirroredStrategy rejects that ("Attempt
        to convert a value (PerReplica...)"), and under MirroredStrategy a first batch that
        splits unevenly over the replicas (a validation set of 51 examples on 2 replicas:
        26 and 25) fails in the ``AddN`` of the mean. The model is fully built by then, so
        give Keras one plain example batch instead; nothing else about building changes.
        Only on the Keras versions known to need it
        (``trainer._compat.keras_bugs.build_from_example_batch``)."""
        if self.num_replicas > 1:
            keras_bugs.build_from_example_batch(model, example_batch)

    def callbacks(self, progress: Any) -> list[keras.callbacks.Callback]:
        """Callbacks to run before every other one (see ``AgreeOnStop``)."""
        if self.kind != "multiworker":
            return []
        self.agreement = AgreeOnStop(self.strategy, progress)
        return [self.agreement]

    def stop_agreement(self) -> contextlib.AbstractContextManager:
        """Enter inside the training loop's signal phase: under multi-worker training the
        workers agree on a stop (``AgreeOnStop``); otherwise nothing changes."""
        if self.agreement is None:
            return contextlib.nullcontext()
        return self.agreement.receiving()

    # ------------------------------------------------------------- where we write
    def output_dir(self, run_dir: Path) -> Path:
        """Where this process writes checkpoints, events and exports: the run directory on
        the chief, a private scratch directory (removed by ``cleanup``) on other workers.
        The chief locks the run directory until ``cleanup``: a second training of the same
        directory is refused before it writes anything."""
        if self.is_chief:
            if self.lock is None:
                self.lock = DirectoryLock(run_dir).acquire()
            return run_dir
        if self.scratch is None:
            prefix = f".worker-{self.task_id}.tmp-"
            for stale in run_dir.glob(f"{prefix}*"):  # left by a killed run of this worker
                remove_path(stale)
            self.scratch = run_dir / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.scratch.mkdir(parents=True)
        return self.scratch

    def backend(self, backend: SaveBackend) -> SaveBackend:
        """The backend as the checkpoint callback should use it in this process."""
        return backend if self.is_chief else ScratchBackend(backend)

    def cleanup(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def describe(self, global_batch: int) -> str:
        if self.strategy is None:
            return "no strategy (one device)"
        role = f"{self.task_type}:{self.task_id}" if self.task_type else "local"
        return (
            f"{type(self.strategy).__name__}, {self.num_replicas} replicas x "
            f"{self.per_replica_batch(global_batch)} examples per step "
            f"({role}{', chief' if self.is_chief else ''})"
        )


class AgreeOnStop(keras.callbacks.Callback):
    """Multi-worker: a SIGTERM/SIGINT that reached any worker stops every worker after the
    same batch, so they all take the interrupt checkpoint and no collective is left waiting.

    While training, this callback's phase (``receiving``, entered inside the loop's own by
    ``Distribution.stop_agreement``) answers the signals: a signal only marks this worker,
    and at each batch end one tiny all-reduce tells every worker whether anyone was
    marked; only then is ``RunProgress.requested_signal`` set, on all workers at the same
    batch. Must come before ``RunProgress``, which reads it at the end of each batch.
    """

    def __init__(self, strategy: tf.distribute.Strategy, progress: Any):
        super().__init__()
        self.strategy = strategy
        self.progress = progress
        self.received: int | None = None

    def receiving(self) -> interrupts.Phase:
        """The phase in which a signal marks this worker (a second Ctrl-C: at once)."""

        def receive(signum, _frame):
            self.received = signum
            log.warning(
                "Received %s: every worker stops after the same batch",
                signal.Signals(signum).name,
            )
            phase.interrupt_at_once()

        phase = interrupts.Phase("multi-worker stop agreement", receive)
        return phase

    def on_train_begin(self, logs=None):
        if self.progress.requested_signal is not None:  # arrived before training began
            self.received, self.progress.requested_signal = self.progress.requested_signal, None

    def on_train_batch_end(self, batch, logs=None):
        mine = 0.0 if self.received is None else 1.0
        flags = self.strategy.experimental_distribute_values_from_function(
            lambda _context: tf.constant(mine)
        )
        anyone = float(self.strategy.reduce(tf.distribute.ReduceOp.SUM, flags, axis=None))
        if anyone > 0 and self.progress.requested_signal is None:
            self.progress.requested_signal = self.received or int(signal.SIGTERM)


class ScratchBackend(WrappingBackend):
    """A non-chief worker's backend: writes like the real one (so every collective the
    save needs runs on this worker too), then removes what it wrote."""

    def save(self, model, path, **kwargs) -> Path:
        written = super().save(model, path, **kwargs)
        remove_path(written)
        return written


def is_chief(task_type: str | None, task_id: int) -> bool:
    """TensorFlow's rule: the ``chief`` task, or worker 0 when the cluster has no chief."""
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    if task_type == "worker" and task_id == 0:
        cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
        return "chief" not in cluster
    return False


def setup(cfg: DictConfig | dict | None) -> Distribution:
    """The strategy ``conf/strategy`` asks for. Call it before any other TensorFlow op:
    logical devices and collective ops can only be configured before TF initialises."""
    options = _as_dict(cfg)
    kind = options.get("kind") or "default"
    if kind not in KINDS:
        raise DistributeError(
            f"strategy.kind must be one of {', '.join(KINDS)} (select it with strategy=NAME). "
            f"Received {kind!r}"
        )
    scale_lr = bool(options.get("scale_lr", False))
    if kind == "default":
        return Distribution(scale_lr=scale_lr)
    # tf.distribute logs every all-reduce it sets up at INFO level.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    logical_cpus = options.get("logical_cpus")
    if logical_cpus is not None:
        if isinstance(logical_cpus, bool) or not isinstance(logical_cpus, int) or logical_cpus < 1:
            # 0 ran silently on the one CPU; a negative count hid every CPU from TensorFlow.
            raise DistributeError(
                f"strategy.logical_cpus must be a whole number of at least 1 (the logical "
                f"devices the CPU is split into), or null to leave the CPU whole. "
                f"Received: strategy.logical_cpus={logical_cpus!r}"
            )
        split_cpu(logical_cpus)
    key = json.dumps({**options, "tf_config": os.environ.get("TF_CONFIG")}, sort_keys=True)
    if key not in _CACHE:
        _CACHE[key] = _build(kind, options)
    strategy = _CACHE[key]
    task_type, task_id = None, 0
    resolver = getattr(strategy, "cluster_resolver", None)
    if kind == "multiworker" and resolver is not None:
        task_type, task_id = resolver.task_type, int(resolver.task_id or 0)
    return Distribution(strategy, kind, task_type, task_id, scale_lr)


def patch_keras_multiworker_mean() -> None:
    """Work around Keras 3.15 under MultiWorkerMirroredStrategy: it reduces every step's
    outputs (scalar metric results) with ``strategy.reduce("MEAN", v, axis=0)``, which fails
    on scalars ("Invalid reduction dimension 0 for input with 0 dimensions",
    tensorflow/tensorflow#72388). Reduce them over replicas with ``axis=None`` instead: the
    mean across replicas, as Keras computes it under MirroredStrategy. Idempotent; only on
    the Keras versions known to need it
    (``trainer._compat.keras_bugs.patch_multiworker_mean_reduction``)."""
    keras_bugs.patch_multiworker_mean_reduction()


def _build(kind: str, options: dict[str, Any]) -> tf.distribute.Strategy:
    if kind == "mirrored":
        devices = options.get("devices")
        if devices:
            check_devices(list(devices))
        elif options.get("logical_cpus"):
            devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        return tf.distribute.MirroredStrategy(devices=list(devices) if devices else None)
    tf_config = os.environ.get("TF_CONFIG")
    if not tf_config:
        raise DistributeError(
            "strategy=multiworker needs the TF_CONFIG environment variable on every worker, "
            'e.g. {"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": '
            '"worker", "index": 0}} (see docs/how-to/multi-worker.md). Received no TF_CONFIG'
        )
    communication = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[str(options.get("communication") or "auto")]
    timeout = options.get("timeout_seconds")
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=communication, timeout_seconds=float(timeout) if timeout else None
    )
    patch_keras_multiworker_mean()
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)


def check_devices(devices: list[Any]) -> None:
    """Refuse a device this process does not have: MirroredStrategy took ``/gpu:7`` on a
    machine without it and trained on the one CPU, silently. Devices are compared by type
    and index (``/gpu:0``, ``/device:GPU:0`` and ``/job:localhost/.../device:GPU:0`` are
    one device) with the logical devices, after ``strategy.logical_cpus`` split the CPU."""
    present = tf.config.list_logical_devices()
    known = {(_device_key(d.name)) for d in present}
    for device in devices:
        try:
            key = _device_key(str(device))
        except ValueError:
            key = None
        if key is None or key not in known:
            names = ", ".join(d.name.split("device:")[-1] for d in present)
            raise DistributeError(
                f"strategy.devices names {device!r}, which this process does not have; its "
                f"devices are {names} (strategy.logical_cpus=N splits the CPU into N; "
                f"strategy.devices=null uses every GPU, else the CPU). "
                f"Received: strategy.devices={[str(d) for d in devices]}"
            )


def _device_key(name: str) -> tuple[str, int] | None:
    """``(TYPE, index)`` of a device name, None without a type; ValueError if malformed."""
    spec = tf.DeviceSpec.from_string(name)
    if not spec.device_type:
        return None
    return spec.device_type.upper(), int(spec.device_index or 0)


def split_cpu(count: int) -> None:
    """Expose the CPU as ``count`` logical devices (to test mirrored training without GPUs)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, wanted)
    except RuntimeError as error:
        raise DistributeError(
            f"Cannot split the CPU into {count} logical devices: TensorFlow already "
            f"initialised its devices in this process. Build the strategy first (train() "
            f"does), e.g. run `python train.py strategy=mirrored "
            f"strategy.logical_cpus={count}` in a fresh process. Received error: {error}"
        ) from error


def scaled_optimizer_cfg(optimizer_cfg: DictConfig, factor: float) -> DictConfig:
    """``optimizer_cfg`` with its learning rate multiplied by ``factor`` (a copy)."""
    if factor == 1.0:
        return optimizer_cfg
    scaled = OmegaConf.create(OmegaConf.to_container(optimizer_cfg, resolve=True))
    scaled.learning_rate = float(scaled.learning_rate) * factor
    return scaled


def _as_dict(cfg: DictConfig | dict | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)
