"""The typed training state (issue 15, item 6): every component's record is a named, typed
field; states written before (records under ``extra``) still load, wrong types are refused."""

from __future__ import annotations

import pytest

from trainer.state import TrainingState


def test_components_have_named_fields_that_round_trip():
    state = TrainingState(
        epoch=2,
        global_step=10,
        history=[{"epoch": 1, "loss": 0.5}],
        checkpoints=[{"name": "step-00000010", "step": 10}],
        metric_variables=[1.0, 2.0],
        numpy_rng=["MT19937", [1, 2], 0, 0, 0.0],
        callbacks={"early_stopping": {"wait": 1, "best": 0.5}},
        stopped_early=True,
        extra={"mine": 1},
    )
    again = TrainingState.from_json(state.to_json())
    assert again == state and again.callbacks["early_stopping"]["wait"] == 1


def test_a_state_from_before_the_typed_fields_still_loads():
    old = {
        "epoch": 1,
        "step_in_epoch": 2,
        "global_step": 5,
        "seed": 0,
        "metrics": {},
        "extra": {"history": [{"epoch": 1}], "checkpoints": [], "numpy_rng": None, "mine": 3},
    }
    state = TrainingState.from_dict(old)
    assert state.history == [{"epoch": 1}] and state.extra == {"mine": 3}


@pytest.mark.parametrize(
    ("field", "value"),
    [("history", {}), ("callbacks", []), ("stopped_early", "yes"), ("numpy_rng", 3)],
)
def test_wrong_types_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        TrainingState.from_dict({field: value})


def test_to_dict_is_a_copy_equal_to_dataclasses_asdict():
    """``to_dict`` copies lists of plain values at once (NumPy's RNG record): the same
    dict as ``dataclasses.asdict``, sharing nothing mutable with the state."""
    import dataclasses

    import numpy as np

    np.random.seed(3)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = TrainingState(
        epoch=2,
        metrics={"loss": 0.5},
        history=[{"epoch": 1, "loss": 0.7}],
        numpy_rng=[kind, keys.tolist(), pos, has_gauss, cached],
        callbacks={"early_stopping": {"wait": 1, "best": 0.4}},
        extra={"mine": [1, {"nested": (1, 2)}, None]},
    )
    copied = state.to_dict()
    assert copied == dataclasses.asdict(state)
    copied["numpy_rng"][1][0] += 1
    copied["extra"]["mine"][1]["nested"] = ()
    copied["callbacks"]["early_stopping"]["wait"] = 9
    assert state.numpy_rng[1][0] == keys[0]
    assert state.extra["mine"][1]["nested"] == (1, 2)
    assert state.callbacks["early_stopping"]["wait"] == 1
