"""Model sizes and shared constants, free of any Keras import.

Both the Keras 3 side (``benchmarks.models``) and the tf_keras anchor subprocess
(``benchmarks.tfkeras_anchor``) read these, so the two build the same architecture; this
module must stay importable without loading Keras 3, which would interfere with tf_keras.
"""

from __future__ import annotations

import dataclasses

INPUT_DIM = 64
NUM_CLASSES = 10
BATCH = 32
# Registration package of the custom block: "class missing" loads unregister it.
PACKAGE = "trainer_bench"
BLOCK_NAME = "DenseResidualBlock"
# The same block without a build() of its own (its sublayers are built by its first call):
# how most custom blocks are written, and a different path through every loader.
NO_BUILD_BLOCK_NAME = "DenseResidualBlockNoBuild"


@dataclasses.dataclass(frozen=True)
class Size:
    """One benchmarked model: ``kind`` is "dense" (stem + residual blocks + head) or
    "mobilenetv2" (``keras.applications.MobileNetV2`` with ``weights=None``)."""

    name: str
    kind: str
    blocks: int = 0
    width: int = 0
    image_size: int = 32
    alpha: float = 0.35
    repeats: int | None = None  # overrides --repeats when set (slow models)
    description: str = ""
    block_build: bool = True  # "dense": whether its custom block defines build()

    @property
    def has_custom_class(self) -> bool:
        return self.kind == "dense"


SIZES: dict[str, Size] = {
    "small": Size("small", "dense", blocks=4, width=64, description="4 blocks of width 64"),
    "large": Size("large", "dense", blocks=16, width=512, description="16 blocks of width 512"),
    "small_nobuild": Size(
        "small_nobuild",
        "dense",
        blocks=4,
        width=64,
        description="4 blocks of width 64, the block without build()",
        block_build=False,
    ),
    "large_nobuild": Size(
        "large_nobuild",
        "dense",
        blocks=16,
        width=512,
        description="16 blocks of width 512, the block without build()",
        block_build=False,
    ),
    "deep": Size("deep", "dense", blocks=64, width=16, description="64 blocks of width 16"),
    "applications": Size(
        "applications",
        "mobilenetv2",
        image_size=32,
        alpha=0.35,
        description="keras.applications.MobileNetV2(alpha=0.35, 32x32x3, weights=None)",
    ),
    # --quick: a tiny model so the whole command runs in well under a minute.
    "tiny": Size("tiny", "dense", blocks=2, width=16, description="2 blocks of width 16"),
}
DEFAULT_SIZES = ("small", "large", "small_nobuild", "large_nobuild", "deep", "applications")
QUICK_SIZES = ("tiny",)


def input_shape(size: Size) -> tuple[int, ...]:
    if size.kind == "dense":
        return (INPUT_DIM,)
    return (size.image_size, size.image_size, 3)
