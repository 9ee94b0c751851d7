"""``trainer import-legacy SRC DST``: convert a legacy tf.keras SavedModel (TensorFlow 2.x
``model.save(dir)``) into a trainer checkpoint holding a compiled, trainable Keras 3 model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainer.errors import NotACheckpointError
from trainer.save_backends import get_backend, legacy


def run(args: argparse.Namespace) -> int:
    """``import-legacy SRC DST [--backend NAME] [--json]``."""
    return import_legacy(args.src, args.dst, args.backend, as_json=args.json)


def import_legacy(src: Path, dst: Path, backend: str, *, as_json: bool) -> int:
    """A legacy tf.keras SavedModel at ``src`` -> a trainer checkpoint at ``dst``."""
    if not legacy.is_legacy(src):
        raise NotACheckpointError(
            f"{src} is not a legacy tf.keras SavedModel (it needs saved_model.pb and "
            f"keras_metadata.pb, and no trainer metadata). Pass the directory TensorFlow "
            f"2.x's model.save(dir) wrote. Received: {str(src)!r}"
        )
    checkpoint = legacy.load_legacy(src)
    written = get_backend(backend).save(checkpoint.model, dst, metadata=checkpoint.metadata)
    report = {"source": str(src), "checkpoint": str(written), "backend": backend}
    report.update(checkpoint.metadata)
    print(json.dumps(report, indent=2) if as_json else legacy_lines(report))
    return 0


def legacy_lines(report: dict) -> str:
    """The text form of a legacy import's report (also ``inspect``'s of a legacy model)."""
    lines = []
    for key, value in report.items():
        if key == "layers":
            lines.append("layers:")
            lines += [f"  {x['name']} ({x['class_name']}): from {x['imports_from']}" for x in value]
        elif key == "legacy_layers":
            lines.append("layers: " + ", ".join(f"{k} from {v}" for k, v in value.items()))
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)
