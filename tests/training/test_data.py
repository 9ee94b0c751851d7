"""The default data set ships in the package: the same digits, without scikit-learn."""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from trainer.data import load_digits

# SHA-256 of images (1797x8x8 uint8) then target (1797 uint8) in digits.npz, as written from
# scikit-learn 1.9.1's load_digits(): a changed array changes every figure trained on it.
DIGITS_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"


def test_digits_load_without_scikit_learn(monkeypatch):
    """scikit-learn is no dependency any more: with it unimportable, the data still loads."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    splits = load_digits(validation_split=0.2, seed=0)
    assert splits.x_train.shape == (1438, 8, 8, 1) and splits.x_val.shape == (359, 8, 8, 1)
    assert splits.x_train.dtype == np.float32 and splits.y_train.dtype == np.int32
    assert splits.num_classes == 10
    assert splits.x_train.min() >= 0.0 and splits.x_train.max() == 1.0


def test_shipped_digits_are_the_published_ones():
    from importlib import resources

    with (resources.files("trainer") / "digits.npz").open("rb") as stream, np.load(stream) as f:
        images, target = f["images"], f["target"]
    assert images.shape == (1797, 8, 8) and target.shape == (1797,)
    assert hashlib.sha256(images.tobytes() + target.tobytes()).hexdigest() == DIGITS_SHA256
    # The UCI set's class sizes (178 zeros ... 180 nines).
    assert np.bincount(target).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
