"""Probe "none" is plain GRPO (docs/probes.md, "none").

The loop builds each policy's batch as ``TrainBatch(scored, group_advantages(rewards,
scale_rewards))`` and lets the probes compose it. The control arm must leave that batch
exactly as plain GRPO made it: the same advantages, no extra loss, and it says so in its
log (transfers = 0). SGT with nothing to transfer must do the same.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks.none import NoSharing
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.data.items import PromptItem
from mrl_lightning.exchange.buffer import ExperienceExchange
from mrl_lightning.objectives.grpo import group_advantages

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
# Plain GRPO, scale_rewards="group" (TRL: Bessel std, eps 1e-4), by hand:
#   [1, 0, 0, 1]: mean 0.5, std sqrt(1/3) = 0.5773503 -> +-0.5 / 0.5774503 = +-0.8658754
#   [1, 1, 1, 0]: mean 0.75, std 0.5 -> 0.25 / 0.5001 = 0.4999000, -0.75 / 0.5001 = -1.4997001
#   [0, 0, 0, 0]: zero variance -> 0
PLAIN_GRPO = torch.tensor([
    [0.8658754, -0.8658754, -0.8658754, 0.8658754],
    [0.4999000, 0.4999000, 0.4999000, -1.4997001],
    [0.0, 0.0, 0.0, 0.0],
])


def _batch():
    items = [PromptItem(f"add/{i}", "q", "a", "add", {}) for i in range(3)]
    scored = SimpleNamespace(items=items, rewards=REWARDS, success=REWARDS >= 1.0, prompt_texts=["q"] * 3)
    return TrainBatch(scored=scored, advantages=group_advantages(REWARDS, "group"))


def test_none_probe_leaves_plain_grpo_advantages_and_adds_nothing():
    batch = _batch()
    torch.testing.assert_close(batch.advantages, PLAIN_GRPO, rtol=0, atol=1e-6)
    NoSharing().on_compose_batch(None, None, SimpleNamespace(policy_name="gpt2"), batch)
    torch.testing.assert_close(batch.advantages, PLAIN_GRPO, rtol=0, atol=1e-6)
    assert batch.aux_losses == []
    assert batch.metrics == {"probe/none/gpt2/transfers": 0.0}


@pytest.mark.parametrize("probe", [NoSharing(), SuccessGatedTransfer(lambda_sgt=0.1)], ids=["none", "sgt-empty"])
def test_probe_with_nothing_to_share_equals_plain_grpo(probe):
    # SGT with an empty exchange: the all-fail prompt (row 2) has no peer success to take.
    batch = _batch()
    trainer = SimpleNamespace(exchange=ExperienceExchange(), rollout_step=1)
    probe.on_compose_batch(trainer, None, SimpleNamespace(policy_name="gpt2", tokenizer=None, max_prompt_length=8),
                           batch)
    assert torch.equal(batch.advantages, group_advantages(REWARDS, "group"))
    assert batch.aux_losses == []
    transfers = [v for k, v in batch.metrics.items() if k.endswith("/transfers")]
    assert transfers == [0.0]
