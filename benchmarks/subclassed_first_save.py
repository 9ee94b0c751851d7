"""The first savedmodel save of a subclassed model, two checkouts side by side: seconds and
the serving traces the save tried.

    python -m benchmarks.subclassed_first_save --old /tmp/subcost-before/src --new src

Why: the save of a subclassed model tries input forms Keras did not record (ids, sparse,
ragged, integer images), each a throwaway trace of the whole model; that is paid on every
first save. Three models: a Dense MLP called on float32, an Embedding model called on
int32 ids, a Dense model called on a ``tf.SparseTensor``. Each child process warms
TensorFlow up with one save, then times ``--saves`` first saves of fresh models of each
kind; the parent alternates old and new children ``--repeats`` times (background load
hits both alike) and prints per checkout and model the median seconds, the throwaway
serving traces (``served_inputs.record_call_specs``), the training-mode tries and the
functions the SavedModel keeps (``FunctionDef``s in ``saved_model.pb``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp_float32", "embedding_int32", "dense_sparse")


def _model(kind: str):
    """A fresh subclassed model of ``kind``, called once on its data."""
    import keras
    import numpy as np
    import tensorflow as tf

    class Net(keras.Model):  # no constructor arguments: its config is its class
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if kind == "mlp_float32":
                self.stack = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
            elif kind == "embedding_int32":
                self.stack = [
                    keras.layers.Embedding(100, 8),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(1),
                ]
            else:
                self.stack = [keras.layers.Dense(4)]

        def call(self, inputs):
            for layer in self.stack:
                inputs = layer(inputs)
            return inputs

    net = Net()
    if kind == "mlp_float32":
        data = np.zeros((4, 8), "float32")
    elif kind == "embedding_int32":
        data = np.ones((4, 10), "int32")
    else:
        data = tf.SparseTensor([[0, 0], [1, 3], [3, 19]], [1.0, 2.0, 3.0], [4, 20])
    net(data)
    return net


def _functions(directory: Path) -> int:
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((directory / "saved_model.pb").read_bytes())
    return len(proto.meta_graphs[0].graph_def.library.function)


def child(saves: int) -> None:
    """Prints ``RESULT {...}``: per model, the seconds of each first save and the tries."""
    from trainer.save_backends import get_backend
    from trainer.save_backends.savedmodel.save import endpoints, served_inputs

    counts = {"serving_traces": 0, "make_serve": 0}
    record, make_serve = served_inputs.record_call_specs, endpoints.make_serve

    def counted_record(*args, **kwargs):
        counts["serving_traces"] += 1
        return record(*args, **kwargs)

    def counted_make_serve(*args, **kwargs):
        counts["make_serve"] += 1
        return make_serve(*args, **kwargs)

    served_inputs.record_call_specs = counted_record
    endpoints.make_serve = counted_make_serve
    backend = get_backend("savedmodel")
    results = {kind: {"seconds": []} for kind in MODELS}
    with tempfile.TemporaryDirectory() as work:
        backend.save(_model("mlp_float32"), Path(work) / "warm")  # imports, first traces
        for i in range(saves):
            for kind in MODELS:
                model = _model(kind)
                counts.update(serving_traces=0, make_serve=0)
                target = Path(work) / f"{kind}_{i}"
                start = time.perf_counter()
                backend.save(model, target)
                results[kind]["seconds"].append(time.perf_counter() - start)
                results[kind].update(counts, functions=_functions(target))
    print("RESULT " + json.dumps(results), flush=True)


def run(src: str, saves: int) -> dict | None:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{ROOT}", TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, "-m", "benchmarks.subclassed_first_save", "--child"]
    done = subprocess.run(
        [*command, "--saves", str(saves)], env=env, cwd=ROOT, capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        print(f"{src}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="src directory of the first checkout")
    parser.add_argument("--new", help="src directory of the second checkout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saves", type=int, default=3, help="first saves per model per child")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.saves)
        return
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(args.repeats):
        for label, src in (("old", args.old), ("new", args.new)):
            result = run(src, args.saves)
            if result is not None:
                runs[label].append(result)
                print(label, json.dumps(result), flush=True)
    for kind in MODELS:
        for label in ("old", "new"):
            if not runs[label]:
                continue
            seconds = [s for r in runs[label] for s in r[kind]["seconds"]]
            last = runs[label][-1][kind]
            print(
                f"{kind:16} {label}: median {statistics.median(seconds):.2f} s "
                f"(min {min(seconds):.2f}, max {max(seconds):.2f}, n={len(seconds)}); "
                f"serving traces {last['serving_traces']}, make_serve {last['make_serve']}, "
                f"functions kept {last['functions']}"
            )


if __name__ == "__main__":
    main()
