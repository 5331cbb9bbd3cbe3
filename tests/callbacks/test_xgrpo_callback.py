"""CrossPolicyAdvantage callback (docs/probes.md): hand-computed advantages from a hand-made exchange."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks import CrossPolicyAdvantage, SharedExperienceExchange
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import ExperienceExchange, GroupStatsRecord
from mrl_lightning.objectives.grpo import group_advantages

EPS = 1e-4
PROMPTS = ["add/0", "add/1", "sub/2"]


def stats(prompt_id: str, source: str, step: int, rewards: list[float]) -> GroupStatsRecord:
    r = torch.tensor(rewards)
    return GroupStatsRecord(prompt_id, source, step, len(rewards), float(r.mean()), float(r.std()),
                            int((r >= 1).sum()))


def run(probe, own_rewards, records, step: int = 3, policy_name: str = "a", prompt_ids=None):
    """Compose one batch for ``policy_name`` with ``probe`` over an exchange holding ``records``
    (rows are ``prompt_ids``, default the first B of ``PROMPTS``)."""
    exchange = ExperienceExchange()
    exchange.publish(records)
    see = SharedExperienceExchange()
    trainer = SimpleNamespace(exchange=exchange, rollout_step=step, callbacks=[see, probe], print=print)
    policies = {"a": SimpleNamespace(policy_name="a", scale_rewards="group"),
                "b": SimpleNamespace(policy_name="b", scale_rewards="group")}
    system = SimpleNamespace(policies=policies)
    assert probe.config_errors(trainer, system) == []
    rewards = torch.tensor(own_rewards)
    items = [SimpleNamespace(prompt_id=pid) for pid in (prompt_ids or PROMPTS[: rewards.shape[0]])]
    batch = TrainBatch(SimpleNamespace(rewards=rewards, items=items), group_advantages(rewards, "group"))
    probe.on_compose_batch(trainer, system, policies[policy_name], batch)
    return batch


OWN = [[0.0, 0.0, 0.0, 0.0],   # all fail; peer b half succeeds
       [1.0, 1.0, 1.0, 1.0],   # all succeed; peer b all fail
       [1.0, 0.0, 0.0, 0.0]]   # no peer data
RECORDS = [
    stats("add/0", "b", 3, [1.0, 1.0, 0.0, 0.0]),
    stats("add/1", "b", 3, [0.0, 0.0, 0.0, 0.0]),
    stats("add/0", "a", 3, [0.0, 0.0, 0.0, 0.0]),  # the receiver's own record: never a peer
    stats("sub/2", "b", 1, [1.0, 1.0, 1.0, 1.0]),  # too old for max_staleness=0
]


def test_all_fail_group_gets_negative_and_all_succeed_group_positive_advantages_by_hand():
    batch = run(CrossPolicyAdvantage(alpha=0.5, scale_source="union", max_staleness=0), OWN, RECORDS)
    # add/0: union of 8 rewards with two 1s: mean 0.25, Bessel var = (2 * 0.75^2 + 6 * 0.25^2) / 7 = 1.5 / 7;
    # b = 0.5 * 0 + 0.5 * 0.25 = 0.125; A = (0 - 0.125) / (sqrt(1.5 / 7) + eps).
    a0 = -0.125 / (math.sqrt(1.5 / 7) + EPS)
    # add/1: union mean 0.5, var = 8 * 0.25 / 7 = 2 / 7; b = 0.5 * 1 + 0.5 * 0.5 = 0.75; A = 0.25 / (sqrt(2/7) + eps).
    a1 = 0.25 / (math.sqrt(2 / 7) + EPS)
    # sub/2: no fresh peer record -> plain GRPO: mean 0.25, std sqrt(0.75 / 3) = 0.5.
    a2 = [0.75 / (0.5 + EPS)] + [-0.25 / (0.5 + EPS)] * 3
    expected = torch.tensor([[a0] * 4, [a1] * 4, a2])
    torch.testing.assert_close(batch.advantages, expected, rtol=0, atol=1e-6)
    m = batch.metrics
    assert m["probe/xgrpo/a/baseline_shift"] == pytest.approx((0.125 + 0.25 + 0.0) / 3)
    assert m["probe/xgrpo/a/zero_var_groups"] == 2.0
    assert m["probe/xgrpo/a/zero_var_signal_share"] == 1.0
    assert m["probe/xgrpo/a/prompts_with_peers"] == 2.0
    assert m["probe/xgrpo/a/peer_groups"] == 2.0


def test_prompt_repeated_in_one_batch_gets_peer_baseline_on_every_copy():
    # The epoch wraps inside the batch: add/0 is rows 0 and 2 (own groups differ), add/1 row 1.
    own = [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    batch = run(CrossPolicyAdvantage(alpha=0.5, scale_source="union"), own, RECORDS,
                prompt_ids=["add/0", "add/1", "add/0"])
    # Row 0 (add/0, all fail) + peer b [1, 1, 0, 0]: as in the first test, b = 0.125,
    # s = sqrt(1.5 / 7): A = -0.125 / (s + eps) = -0.2700 (plain GRPO would give 0).
    a0 = -0.125 / (math.sqrt(1.5 / 7) + EPS)
    # Row 1 (add/1, all succeed) + peer b all fail: b = 0.75, s = sqrt(2 / 7).
    a1 = 0.25 / (math.sqrt(2 / 7) + EPS)
    # Row 2 (add/0 again) own [1, 0, 0, 0] + peer b [1, 1, 0, 0]: union mean 3/8,
    # Bessel var (3 * (5/8)^2 + 5 * (3/8)^2) / 7 = 15 / 56; b = 0.5 * 0.25 + 0.5 * 0.375 = 0.3125.
    s2 = math.sqrt(15 / 56)
    a2 = [(1.0 - 0.3125) / (s2 + EPS)] + [-0.3125 / (s2 + EPS)] * 3
    expected = torch.tensor([[a0] * 4, [a1] * 4, a2])
    torch.testing.assert_close(batch.advantages, expected, rtol=0, atol=1e-6)
    m = batch.metrics
    assert m["probe/xgrpo/a/prompts_with_peers"] == 3.0  # rows (prompt copies) with peer data
    assert m["probe/xgrpo/a/peer_groups"] == 2.0  # b's add/0 and add/1 records, each counted once
    assert m["probe/xgrpo/a/zero_var_signal_share"] == 1.0


def test_staleness_window_admits_older_peer_groups_newest_per_peer():
    records = RECORDS + [stats("add/1", "b", 2, [1.0, 1.0, 1.0, 1.0])]  # older than the step-3 record of b
    batch = run(CrossPolicyAdvantage(alpha=1.0, scale_source="union", max_staleness=2), OWN, records)
    # sub/2 now has b's step-1 group (all succeed): union 4 zeros... own [1,0,0,0] + [1,1,1,1]:
    # mean 5/8, var = (5 * 0.375^2 + 3 * 0.625^2) / 7; b = 5/8 (alpha = 1).
    std = math.sqrt((5 * 0.375**2 + 3 * 0.625**2) / 7)
    expected = torch.tensor([1.0 - 0.625, -0.625, -0.625, -0.625]) / (std + EPS)
    torch.testing.assert_close(batch.advantages[2], expected, rtol=0, atol=1e-6)
    # add/1 uses b's newest group (step 3, all fail), not the step-2 one: b = union mean 0.5.
    assert batch.advantages[1, 0].item() == pytest.approx(0.5 / (math.sqrt(2 / 7) + EPS), abs=1e-6)


def test_alpha_zero_with_own_scale_equals_plain_grpo():
    batch = run(CrossPolicyAdvantage(alpha=0.0, scale_source="own"), OWN, RECORDS)
    torch.testing.assert_close(batch.advantages, group_advantages(torch.tensor(OWN), "group"), rtol=0, atol=1e-7)
    mixed = [[1.0, 0.0, 1.0, 0.0], [0.5, 0.0, 1.0, 1.0], [0.0, 0.25, 0.0, 0.0]]
    batch = run(CrossPolicyAdvantage(alpha=0.0, scale_source="own"), mixed, RECORDS)
    torch.testing.assert_close(batch.advantages, group_advantages(torch.tensor(mixed), "group"), rtol=0, atol=1e-7)


@pytest.mark.parametrize("scale_source", ["union", "own"])
def test_alpha_zero_equals_plain_grpo_exactly_on_non_binary_rewards(scale_source):
    # Groups of eight equal rewards 0.1 / 0.3 / 0.7 (peer b has varied groups on all three prompts):
    # plain GRPO gives exactly 0, and so must XGRPO with alpha 0; none of them is a "signal".
    own = [[0.1] * 8, [0.3] * 8, [0.7] * 8]
    records = [stats(pid, "b", 3, [0.0, 1.0, 0.5, 0.5]) for pid in PROMPTS]
    batch = run(CrossPolicyAdvantage(alpha=0.0, scale_source=scale_source), own, records)
    assert torch.equal(batch.advantages, torch.zeros(3, 8))
    assert torch.equal(batch.advantages, group_advantages(torch.tensor(own), "group"))
    assert batch.metrics["probe/xgrpo/a/zero_var_groups"] == 3.0
    assert batch.metrics["probe/xgrpo/a/zero_var_signal_share"] == 0.0
    assert batch.metrics["probe/xgrpo/a/baseline_shift"] == 0.0


def test_alpha_zero_own_scale_is_bit_identical_to_plain_grpo_on_mixed_rewards():
    own = [[0.1, 0.3, 0.7, 0.1], [0.4, 0.4, 0.4, 1.0], [0.7, 0.7, 0.7, 0.7]]
    batch = run(CrossPolicyAdvantage(alpha=0.0, scale_source="own"), own, RECORDS)
    assert torch.equal(batch.advantages, group_advantages(torch.tensor(own), "group"))


def test_own_scale_with_positive_alpha_is_refused_at_construction():
    with pytest.raises(ConfigError) as err:
        CrossPolicyAdvantage(alpha=0.5, scale_source="own")
    text = str(err.value)
    assert "scale_source='own' with alpha=0.5" in text and "scale_source='union'" in text
    CrossPolicyAdvantage(alpha=0.0, scale_source="own")  # plain GRPO: allowed


def test_nan_own_reward_row_keeps_plain_grpo_advantages():
    own = [[0.0, 0.0, 0.0, 0.0], [1.0, float("nan"), 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    batch = run(CrossPolicyAdvantage(alpha=0.5), own, RECORDS)
    plain = group_advantages(torch.tensor(own), "group")
    torch.testing.assert_close(batch.advantages[1:], plain[1:], rtol=0, atol=0)
    assert (batch.advantages[0] < 0).all()
    assert batch.metrics["probe/xgrpo/a/nan_rows_skipped"] == 1.0


def test_non_receiver_is_left_alone():
    batch = run(CrossPolicyAdvantage(receivers=["b"]), OWN, RECORDS)
    torch.testing.assert_close(batch.advantages, group_advantages(torch.tensor(OWN), "group"), rtol=0, atol=0)
    assert batch.metrics == {}


def test_invalid_options_are_all_reported():
    with pytest.raises(ConfigError) as err:
        CrossPolicyAdvantage(alpha=1.5, scale_source="batch", eps=0.0, max_staleness=-1)
    text = str(err.value)
    for expected in ("alpha=1.5", "scale_source='batch'", "'union'", "eps=0.0", "max_staleness=-1"):
        assert expected in text


def test_config_errors_need_see_known_receivers_and_group_scaling():
    probe = CrossPolicyAdvantage(receivers=["a", "ghost"])
    policies = {"a": SimpleNamespace(scale_rewards="batch"), "b": SimpleNamespace(scale_rewards="group")}
    from mrl_lightning.callbacks.base import service_errors

    errors = probe.config_errors(SimpleNamespace(callbacks=[probe]), SimpleNamespace(policies=policies))
    errors += service_errors([probe])
    assert any("'ghost'" in e for e in errors)
    assert any("scale_rewards='batch'" in e and "scale_rewards: group" in e for e in errors)
    assert any("SharedExperienceExchange" in e for e in errors)
