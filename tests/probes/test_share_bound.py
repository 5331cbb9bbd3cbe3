"""The moving bound on SGT's share of the update (mrl_lightning/probes/sgt.py ShareBound); values by hand."""

from __future__ import annotations

import pytest

from mrl_lightning.callbacks import SuccessGatedTransfer
from mrl_lightning.errors import ConfigError
from mrl_lightning.probes.sgt import ShareBound


def test_a_fixed_bound_and_none():
    assert ShareBound(0.3).step_bound(0) == 0.3 and ShareBound(0.3).step_bound(10_000) == 0.3
    assert ShareBound(None).step_bound(5) is None


def test_a_schedule_moves_linearly_then_stays():
    bound = ShareBound(0.3, final=0.6, ramp_steps=1000)
    assert bound.step_bound(0) == pytest.approx(0.3)
    assert bound.step_bound(250) == pytest.approx(0.375)  # 0.3 + 0.3 * 0.25
    assert bound.step_bound(1000) == pytest.approx(0.6) and bound.step_bound(5000) == pytest.approx(0.6)


def test_the_adaptive_bound_follows_the_strong_part_against_its_reference():
    bound = ShareBound(0.6, low=0.2, drop=0.2, ema=0.5, reference_steps=2)
    state: dict = {"level": None, "reference": None}
    bound.track(state, 0, successes=8, count=10)   # level 0.8, reference 0.8
    bound.track(state, 1, successes=10, count=10)  # level 0.5*0.8 + 0.5*1.0 = 0.9, reference 0.9
    assert state == pytest.approx({"level": 0.9, "reference": 0.9})
    assert bound.step_bound(1, **state) == pytest.approx(0.6)  # holding: the high bound
    bound.track(state, 2, successes=6, count=10)   # level 0.75, reference stays 0.9 (step >= 2)
    # ratio 0.75 / 0.9 = 0.8333: a drop of 0.1667 of the 0.2 that reaches the floor -> 0.6 - 0.4 * 0.8333
    assert bound.step_bound(2, **state) == pytest.approx(0.6 - 0.4 * (1 - 0.75 / 0.9) / 0.2)
    bound.track(state, 3, successes=0, count=10)   # level 0.375: ratio 0.4167 -> the floor
    assert bound.step_bound(3, **state) == pytest.approx(0.2)
    bound.track(state, 4, successes=0, count=0)    # no strong-part rollout: nothing changes
    assert state["level"] == pytest.approx(0.375)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_grad_share": 0.3, "max_grad_share_final": 1.5}, "final=1.5 must be in"),
    ({"max_grad_share": 0.3, "max_grad_share_final": 0.5, "max_grad_share_low": 0.1}, "cannot both be set"),
    ({"max_grad_share": None, "max_grad_share_low": 0.1}, "needs max_grad_share"),
])
def test_bad_bound_options_are_named_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SuccessGatedTransfer(**kwargs)
