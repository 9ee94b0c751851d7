"""TF Serving warmup requests: ``assets.extra/tf_serving_warmup_requests`` in an export.

A TFRecord file of ``tensorflow.serving.PredictionLog`` protos that the model server
replays when it loads a version, so the first real request does not pay for graph
initialisation. The protos come from ``tensorflow-serving-api``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from trainer.errors import ExportError
from trainer.model_state.serving import SERVING_KEY
from trainer.storage.integrity import MANIFEST_FILE

EXTRA_DIR = "assets.extra"
WARMUP_FILE = "tf_serving_warmup_requests"
# The other files trainer puts next to the requests in an export (``trainer.exports.exporter``):
# what was exported, and the manifest of every file of the export, written last.
EXPORT_FILE = "trainer_export.json"
EXPORT_MANIFEST = f"{EXTRA_DIR}/{MANIFEST_FILE}"
# TF Serving's limit (``WarmupConsts::kMaxNumRecords`` in saved_model_warmup_util.cc): a
# warmup file holding more records fails the version's load with InvalidArgument, so an
# export with more would never be served. Asking for more is refused, never cut silently.
MAX_WARMUP_REQUESTS = 1000


def write_warmup(version_dir: Path, examples: Any, inputs: Mapping[str, Mapping[str, Any]]) -> int:
    """TF Serving warmup: a TFRecord of ``PredictionLog`` protos, one request per example,
    every example given (at most ``MAX_WARMUP_REQUESTS``: it was cut to 100, silently).
    Needs ``tensorflow-serving-api`` for the protos."""
    try:
        from tensorflow_serving.apis import predict_pb2, prediction_log_pb2
    except ImportError as error:
        raise ExportError(
            f"Warmup requests need the TF Serving protos: pip install tensorflow-serving-api "
            f"(or export without warmup). Received ImportError: {error}"
        ) from None
    if not isinstance(examples, Mapping):
        if len(inputs) != 1:
            raise ExportError(
                f"The model has {len(inputs)} inputs ({sorted(inputs)}); pass warmup examples "
                f"as a dict keyed by input name. Received {type(examples).__name__}"
            )
        examples = {next(iter(inputs)): examples}
    unknown = sorted(set(examples) ^ set(inputs))
    if unknown:
        raise ExportError(
            f"Warmup examples must name exactly the signature inputs {sorted(inputs)}. "
            f"Received keys {sorted(examples)}"
        )
    arrays = {name: _as_array(value, inputs[name]["dtype"]) for name, value in examples.items()}
    count = min(len(a) for a in arrays.values())
    check_warmup_limit(count, "warmup=... (one request per example)")
    path = version_dir / EXTRA_DIR / WARMUP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(count):
            request = predict_pb2.PredictRequest()
            request.model_spec.signature_name = SERVING_KEY
            for name, array in arrays.items():
                request.inputs[name].CopyFrom(tf.make_tensor_proto(array[i : i + 1]))
            record = prediction_log_pb2.PredictionLog(
                predict_log=prediction_log_pb2.PredictLog(request=request)
            )
            writer.write(record.SerializeToString())
    return count


def check_warmup_limit(count: int, what: str) -> None:
    """Refuse more warmup requests than TF Serving loads (see ``MAX_WARMUP_REQUESTS``)."""
    if count > MAX_WARMUP_REQUESTS:
        raise ExportError(
            f"{what} asks for {count} TF Serving warmup requests; TF Serving refuses to load "
            f"a version whose warmup file holds more than {MAX_WARMUP_REQUESTS} "
            f"(saved_model_warmup_util: 'Number of warmup records exceeds the maximum'). "
            f"Ask for at most {MAX_WARMUP_REQUESTS}; a few cover every traced shape. "
            f"Received: {count}"
        )


def count_warmup(version_dir: Path) -> int:
    """How many requests the export's warmup file holds (0 without one); reading it whole
    proves it is a readable TFRecord file, which TF Serving needs to load the version."""
    path = Path(version_dir) / EXTRA_DIR / WARMUP_FILE
    if not path.is_file():
        return 0
    return sum(1 for _ in tf.data.TFRecordDataset(str(path)))


def _as_array(value: Any, dtype: str) -> np.ndarray:
    """Examples as an array of the input's dtype; strings as an object array of ``bytes``
    or ``str``, which ``tf.make_tensor_proto`` stores as ``DT_STRING`` (NumPy has no
    dtype named "string": such a model's warmup raised a raw TypeError)."""
    if isinstance(value, tf.Tensor):
        value = value.numpy()
    if tf.as_dtype(dtype) == tf.string:
        return np.asarray(value, dtype=object)
    return np.asarray(value, dtype=dtype)
