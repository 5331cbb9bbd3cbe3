"""Hostile reward functions and verifiers (docs/reliability.md, "Rewards")."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from mrl_lightning.data.items import PromptItem
from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.rewards import RewardError, RewardFunction, TimeLimitedReward, checked_rewards

ITEMS = [PromptItem(f"add/{i}", f"{i} + 1 =", str(i + 1), "add", {}) for i in range(4)]
TEXTS = [" 1", " 2", " 3", " 5"]


class Returns(RewardFunction):
    """Returns a fixed value (or calls a function) whatever it is asked."""

    name, version, strict = "fixed", "1", True

    def __init__(self, value):
        self.value = value

    def __call__(self, completions, items):
        return self.value(completions, items) if callable(self.value) else self.value


def test_reward_function_returning_too_few_values_is_an_error_naming_it():
    with pytest.raises(RewardError) as info:
        checked_rewards(Returns([1.0, 0.0, 1.0]), TEXTS, ITEMS)
    msg = str(info.value)
    assert "'fixed'" in msg and "3 values for 4 completions" in msg and "exactly one per completion" in msg


def test_reward_function_returning_none_as_a_whole_is_an_error():
    with pytest.raises(RewardError, match="returned NoneType 'None'; it must return a list of 4 numbers"):
        checked_rewards(Returns(None), TEXTS, ITEMS)


def test_reward_function_that_raises_is_named_with_its_exception_chained():
    def boom(completions, items):
        raise KeyError("metadata")

    with pytest.raises(RewardError) as info:
        checked_rewards(Returns(boom), TEXTS, ITEMS)
    assert "'fixed'" in str(info.value) and "raised KeyError" in str(info.value) and "add/0" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)


def test_none_entries_are_not_scored_and_get_zero_advantage():
    rewards = checked_rewards(Returns([1.0, None, 0.0, None]), TEXTS, ITEMS)
    assert torch.isnan(rewards[1]) and torch.isnan(rewards[3])
    adv = group_advantages(rewards.view(1, 4))
    # valid rewards 1 and 0: mean 0.5, Bessel std sqrt(0.5) = 0.7071; the two None entries get 0
    expected = torch.tensor([[0.5 / (0.5 ** 0.5 + 1e-4), 0.0, -0.5 / (0.5 ** 0.5 + 1e-4), 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_nan_reward_is_left_out_of_its_group_and_gets_zero_advantage():
    rewards = checked_rewards(Returns([1.0, math.nan, 0.0, 1.0]), TEXTS, ITEMS)
    adv = group_advantages(rewards.view(1, 4))
    # valid 1, 0, 1: mean 2/3, Bessel std sqrt(((1/3)^2*2 + (2/3)^2)/2) = sqrt(1/3)
    std = (1 / 3) ** 0.5 + 1e-4
    assert torch.allclose(adv, torch.tensor([[(1 / 3) / std, 0.0, -(2 / 3) / std, (1 / 3) / std]]), atol=1e-6)


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_infinite_reward_is_an_error_naming_the_entry(value):
    with pytest.raises(RewardError) as info:
        checked_rewards(Returns([0.0, 1.0, value, 0.0]), TEXTS, ITEMS)
    msg = str(info.value)
    assert f"returned {value} at index 2" in msg and "add/2" in msg and "finite" in msg


def test_string_reward_is_an_error_naming_its_type_and_index():
    with pytest.raises(RewardError) as info:
        checked_rewards(Returns([0.0, "1.0", 1.0, 0.0]), TEXTS, ITEMS)
    assert "returned str '1.0' at index 1" in str(info.value) and "float()" in str(info.value)


def test_numpy_and_tensor_results_are_accepted_as_numbers():
    assert checked_rewards(Returns(np.array([1, 0, 1, 0])), TEXTS, ITEMS).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert checked_rewards(Returns(torch.tensor([0.5, 0.0, 1.0, 0.25])), TEXTS, ITEMS).tolist() == [0.5, 0.0, 1.0, 0.25]
    assert checked_rewards(Returns([np.float32(1.0), True, 0, None]), TEXTS, ITEMS)[:3].tolist() == [1.0, 1.0, 0.0]


def test_score_checks_every_reward_function_of_the_system(make_policy):
    from mrl_lightning.loop.system import MutualRL

    system = MutualRL(policies=[make_policy()], reward_funcs=[Returns([1.0, 0.0, 1.0, 0.0]), Returns([1.0] * 3)])
    with pytest.raises(RewardError, match="3 values for 4 completions"):
        system.score(TEXTS, ITEMS)


def _hang(completions, items):
    while True:  # a verifier stuck in Python code (a regex or a simplification that never ends)
        time.sleep(0.01)


def test_hanging_verifier_is_bounded_counted_and_the_run_goes_on():
    calls = iter([_hang, lambda c, i: [1.0] * len(c)])
    bounded = TimeLimitedReward(Returns(lambda c, i: next(calls)(c, i)), timeout_s=0.3)
    start = time.monotonic()
    with pytest.warns(UserWarning, match="'fixed' ran past timeout_s=0.3 s.*Timeouts so far: 1 of 1"):
        first = checked_rewards(bounded, TEXTS, ITEMS)
    assert time.monotonic() - start < 2.0
    assert torch.isnan(first).all() and bounded.timeouts == 1
    assert checked_rewards(bounded, TEXTS, ITEMS).tolist() == [1.0] * 4  # the next call is scored again
    assert (bounded.calls, bounded.timeouts, bounded.name, bounded.strict) == (2, 1, "fixed", True)


def test_hanging_verifier_off_the_main_thread_is_abandoned_and_scores_nan():
    bounded = TimeLimitedReward(Returns(_hang), timeout_s=0.3)
    out = {}

    def score():
        with pytest.warns(UserWarning, match="ran past"):
            out["rewards"] = checked_rewards(bounded, TEXTS, ITEMS)

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(5.0)
    assert not worker.is_alive() and torch.isnan(out["rewards"]).all() and bounded.timeouts == 1


def test_time_limit_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        TimeLimitedReward(Returns([1.0]), timeout_s=0)
