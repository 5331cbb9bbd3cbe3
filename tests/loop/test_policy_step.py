"""``trainer.steps_per_round``'s schedule, checks and resume rule (mrl_lightning/loop/policy_step.py;
docs/mwra.md, "Steps per round")."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mrl_lightning.errors import ConfigError
from mrl_lightning.loop.policy_step import (check_resume_steps_per_round, rates, round_counters, solo_count,
                                            steps_per_round_errors)

POLICIES = {"smollm2": SimpleNamespace(filter_groups=False), "gemma": SimpleNamespace(filter_groups=True)}


@given(tenths=st.integers(10, 80), rounds=st.integers(1, 400))
def test_a_rate_gives_floor_r_k_steps_over_r_rounds_and_at_most_one_more_than_its_mean_in_any(tenths, rounds):
    rate = rates({"p": tenths / 10})["p"] if tenths > 10 else None
    counts = [solo_count(rate, r) for r in range(1, rounds + 1)]
    assert sum(counts) + rounds == math.floor(rounds * Fraction(tenths, 10))  # exact: 1.3 is 13/10, not a binary float
    assert all(math.floor(tenths / 10) - 1 <= c <= math.ceil(tenths / 10) - 1 for c in counts)


def test_the_rate_is_the_decimal_written_so_ten_rounds_at_one_point_three_take_thirteen_steps():
    assert rates({"p": 1.3, "q": 1, "r": 1.0}) == {"p": Fraction(13, 10)}
    assert [solo_count(Fraction(13, 10), r) for r in range(1, 11)] == [0, 0, 0, 1, 0, 0, 1, 0, 0, 1]
    assert round_counters({"q": 1}) == {} and round_counters({"p": 1.5}) == {"steps_per_round": {"p": "3/2"}}


@pytest.mark.parametrize("value, async_rollouts, policy, expected", [
    ({"smollm": 2}, False, "smollm", "'smollm' is no policy of this run (smollm2, gemma); did you mean 'smollm2'?"),
    ({"smollm2": 0.5}, False, "smollm2", "trainer.steps_per_round['smollm2']=0.5 must be a number from 1 to 64"),
    ({"smollm2": float("nan")}, False, "smollm2", "=nan must be a number from 1 to 64"),
    ({"smollm2": True}, False, "smollm2", "=True must be a number"),
    ({"smollm2": 1.5}, True, "smollm2", "trainer.async_rollouts=true samples every batch during the update before"),
    ({"gemma": 2}, False, "gemma", "policy 'gemma' has filter_groups: true"),
])
def test_every_bad_value_is_refused_in_one_line_naming_it(value, async_rollouts, policy, expected):
    errors = steps_per_round_errors(value, POLICIES, async_rollouts)
    assert len(errors) == 1 and expected in errors[0] and "\n" not in errors[0]


def test_good_values_and_rate_one_with_async_or_filter_groups_pass():
    assert steps_per_round_errors({"smollm2": 1.25, "gemma": 1}, POLICIES, False) == []
    assert steps_per_round_errors({"smollm2": 1, "gemma": 1.0}, POLICIES, True) == []
    assert steps_per_round_errors(None, POLICIES, True) == []


def test_a_resume_under_another_setting_is_refused_naming_the_flag_that_resumes():
    saved = round_counters({"smollm2": 1.5})
    check_resume_steps_per_round(saved, {"smollm2": 1.5, "gemma": 1}, "a.ckpt")
    check_resume_steps_per_round({}, None, "a.ckpt")
    with pytest.raises(ConfigError, match=r"""Resume with --trainer.steps_per_round '\{"smollm2": 1.5\}'"""):
        check_resume_steps_per_round(saved, {"smollm2": 2}, "a.ckpt")
    with pytest.raises(ConfigError, match="written with none above 1"):
        check_resume_steps_per_round({}, {"smollm2": 2}, "a.ckpt")


def test_the_plan_names_the_rates_and_a_resume_without_any_is_told_to_pass_null():
    from mrl_lightning.loop.policy_step import rates_line

    assert rates_line(None) == "" and rates_line({"smollm2": 1}) == ""
    assert "steps per exchange round: smollm2 1.25 (its extra steps are solo steps" in rates_line({"smollm2": 1.25})
    with pytest.raises(ConfigError, match=r'is \{"smollm2": 2.0\} here, .* --trainer.steps_per_round null\.$'):
        check_resume_steps_per_round({}, {"smollm2": 2}, "a.ckpt")
