"""Rollout scalars (``mrl_lightning.loop.reporting.rollout_metrics``): what a NaN reward does to the group counts.

A NaN reward is "not scored" (docs/reliability.md, docs/grpo.md): it is left out of its group, so
a group's GRPO signal is that of its scored rewards alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.data.items import PromptItem
from mrl_lightning.loop.reporting import rollout_metrics

NAN = float("nan")


def _scored(rewards: list[list[float]]) -> SimpleNamespace:
    """A policy's scored rollouts of ``len(rewards)`` prompts with the given ``[B, G]`` rewards."""
    r = torch.tensor(rewards)
    b, g = r.shape
    rollouts = SimpleNamespace(completion_mask=torch.ones(b * g, 3, dtype=torch.bool),
                               truncated=torch.zeros(b * g, dtype=torch.bool))
    items = [PromptItem(f"add/{i}", "q", "a", "add", {}) for i in range(b)]
    return SimpleNamespace(policy="p", rewards=r, rollouts=rollouts, success=(r >= 1.0).reshape(-1), items=items,
                           num_generations=g)


def test_groups_whose_scored_rewards_tie_count_as_without_signal_despite_a_nan():
    scored = _scored([[1.0, 1.0, NAN], [0.0, 0.0, NAN], [0.0, 1.0, 1.0]])
    metrics = rollout_metrics(scored, SimpleNamespace())
    assert float(metrics["rollout/p/zero_std_group_share"]) == pytest.approx(2 / 3)
    assert float(metrics["rollout/p/nan_reward_share"]) == pytest.approx(2 / 9)


def test_a_group_with_fewer_than_two_scored_rewards_has_no_signal_and_a_spread_with_a_nan_has_one():
    scored = _scored([[NAN, NAN, 1.0], [NAN, NAN, NAN], [0.0, NAN, 1.0], [0.5, 0.5, 0.5]])
    assert float(rollout_metrics(scored, SimpleNamespace())["rollout/p/zero_std_group_share"]) == 0.75
