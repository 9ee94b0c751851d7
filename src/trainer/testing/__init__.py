"""The save-backend contract suite, shipped so that any backend can be tested against it.

Every built-in backend runs it, and so should yours::

    import pytest
    from trainer.testing import BackendSuite

    from mypkg.backends import MyBackend

    class TestMyBackend(BackendSuite):
        @pytest.fixture
        def backend(self):
            return MyBackend()

``pytest`` then runs the round trip (save a trained model of each kind, load it: same
predictions, same state and metadata, bitwise-identical model and optimizer variables, same
``evaluate``, bitwise-identical continued training) and the safety checks (an unbuilt model is
refused, saving over a checkpoint replaces it atomically, a crashed writer's leftovers are never
loaded). See ``BackendSuite`` for the options.

``trainer.testing`` needs pytest, which is not a dependency of trainer itself: install the
``test`` extra (``pip install -e ".[test]"`` in a checkout) or pytest alone. Nothing in
trainer imports this package; it is for test code only. Importing it imports Keras and
TensorFlow and registers the suite's model classes with Keras.
"""

from __future__ import annotations

from trainer.testing.suite import (
    SAFETY_CHECKS,
    BackendSuite,
    check_atomic_replace,
    check_backend,
    check_crash_leftovers_not_loadable,
    check_round_trip,
    check_unbuilt_model_rejected,
)
from trainer.testing.suite_models import (
    BATCH,
    CLASSES,
    FEATURES,
    MODEL_KINDS,
    SEED,
    SuiteBlock,
    SuiteSubclassed,
    all_values,
    assert_bitwise_equal,
    build_model,
    deterministic,
    outputs,
    suite_data,
    train,
)

__all__ = [
    "BATCH",
    "CLASSES",
    "FEATURES",
    "MODEL_KINDS",
    "SAFETY_CHECKS",
    "SEED",
    "BackendSuite",
    "SuiteBlock",
    "SuiteSubclassed",
    "all_values",
    "assert_bitwise_equal",
    "build_model",
    "check_atomic_replace",
    "check_backend",
    "check_crash_leftovers_not_loadable",
    "check_round_trip",
    "check_unbuilt_model_rejected",
    "deterministic",
    "outputs",
    "suite_data",
    "train",
]
