"""XGRPO advantages (SPEC 3.3): hand-computed values and the plain-GRPO reduction."""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.exchange import GroupStatsRecord
from mrl_lightning.probes.xgrpo import (
    peer_moments,
    peer_stats_from_records,
    xgrpo_advantages,
    xgrpo_advantages_from_stats,
    xgrpo_baseline_scale,
    xgrpo_metrics,
)

EPS = 1e-4


def grpo_group_advantages(rewards: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Plain GRPO, SPEC 2 scale_rewards="group": (r - mean) / (std + eps), Bessel std as TRL."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)


def test_all_fail_group_gets_negative_advantage_from_succeeding_peers():
    own = torch.zeros(1, 4)
    peers = [torch.ones(4)]
    # union = four 0s and four 1s: mean 0.5; Bessel var = 8 * 0.25 / 7 = 2/7.
    # b = 0.5 * 0 + 0.5 * 0.5 = 0.25;  A = (0 - 0.25) / (sqrt(2/7) + 1e-4) = -0.4676197
    adv = xgrpo_advantages(own, peers, alpha=0.5, scale_source="union")
    expected = -0.25 / (math.sqrt(2 / 7) + EPS)
    assert expected == pytest.approx(-0.4676197, abs=1e-7)
    torch.testing.assert_close(adv, torch.full((1, 4), expected), rtol=0, atol=1e-6)
    # Plain GRPO gives exactly zero on the same group.
    assert torch.equal(grpo_group_advantages(own), torch.zeros(1, 4))


def test_all_succeed_group_gets_positive_advantage_when_peers_fail():
    own = torch.ones(1, 4)
    peers = torch.zeros(1, 4)  # padded form: two peers of G=2 on the one prompt; same union as above
    # b = 0.5 * 1 + 0.5 * 0.5 = 0.75;  A = (1 - 0.75) / (sqrt(2/7) + 1e-4) = +0.4676197
    adv = xgrpo_advantages(own, peers, alpha=0.5)
    torch.testing.assert_close(adv, torch.full((1, 4), 0.25 / (math.sqrt(2 / 7) + EPS)), rtol=0, atol=1e-6)


def test_own_scale_on_zero_variance_group_divides_by_eps():
    # scale_source="own": s = std(0, 0, 0, 0) = 0, so A = -0.25 / 1e-4 = -2500 (why "union" is the default).
    adv = xgrpo_advantages(torch.zeros(1, 4), [torch.ones(4)], alpha=0.5, scale_source="own")
    torch.testing.assert_close(adv, torch.full((1, 4), -2500.0), rtol=1e-5, atol=0)


def test_alpha_one_uses_union_mean_and_std_by_hand():
    own = torch.tensor([[1.0, 0.0]])
    # union = [1, 0, 1, 1]: mean 0.75; Bessel var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5.
    # A = (1 - 0.75) / 0.5001 = 0.4999000, (0 - 0.75) / 0.5001 = -1.4997001
    adv = xgrpo_advantages(own, [torch.tensor([1.0, 1.0])], alpha=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.4999000, -1.4997001]]), rtol=0, atol=1e-6)


def test_alpha_zero_own_scale_equals_plain_grpo_exactly():
    g = torch.Generator().manual_seed(0)
    own = torch.randint(0, 2, (5, 8), generator=g).float()
    own[0] = 1.0  # an all-success group and an all-fail group
    own[1] = 0.0
    peers = torch.rand(5, 6, generator=g)
    adv = xgrpo_advantages(own, peers, alpha=0.0, scale_source="own")
    assert torch.equal(adv, grpo_group_advantages(own))
    # By hand for one row: [1, 0, 0, 0] -> mean 0.25, Bessel std sqrt(0.75 / 3) = 0.5.
    hand = xgrpo_advantages(torch.tensor([[1.0, 0, 0, 0]]), [torch.ones(3)], alpha=0.0, scale_source="own")
    torch.testing.assert_close(hand, torch.tensor([[0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001]]))


def test_prompt_without_peers_is_plain_grpo_for_any_alpha():
    own = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv = xgrpo_advantages(own, [torch.empty(0), torch.empty(0)], alpha=0.7)
    torch.testing.assert_close(adv, grpo_group_advantages(own), rtol=0, atol=1e-6)


def test_padded_masked_peers_equal_ragged_list():
    own = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    padded = torch.tensor([[1.0, 0.5, 9.0], [0.0, 9.0, 9.0]])  # 9.0 = padding, must be ignored
    mask = torch.tensor([[True, True, False], [True, False, False]])
    ragged = [torch.tensor([1.0, 0.5]), torch.tensor([0.0])]
    a = xgrpo_advantages(own, padded, alpha=0.4, peer_mask=mask)
    b = xgrpo_advantages(own, ragged, alpha=0.4)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_group_stats_records_give_the_same_advantages_as_raw_rewards():
    own = torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    raw = {("p0", "b"): [1.0, 1.0, 0.0], ("p0", "c"): [0.5], ("p1", "b"): [0.0, 0.25]}
    records = [
        GroupStatsRecord(pid, src, 3, len(r), sum(r) / len(r),
                         float(torch.tensor(r).std()) if len(r) > 1 else float("nan"), 0)
        for (pid, src), r in raw.items()
    ] + [GroupStatsRecord("other", "b", 3, 2, 1.0, 0.0, 2)]
    count, mean, std = peer_stats_from_records(records, ["p0", "p1"])
    assert count.tolist() == [[3.0, 1.0], [2.0, 0.0]]
    from_stats = xgrpo_advantages_from_stats(own, count, mean, std, alpha=0.6)
    from_raw = xgrpo_advantages(own, [torch.tensor([1.0, 1.0, 0.0, 0.5]), torch.tensor([0.0, 0.25])], alpha=0.6)
    torch.testing.assert_close(from_stats, from_raw, rtol=0, atol=1e-6)


def test_metrics_report_baseline_shift_and_rescued_zero_variance_share():
    own = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    peers = [torch.ones(2), torch.empty(0), torch.tensor([1.0])]
    peer = peer_moments(peers, 3)
    baseline, _ = xgrpo_baseline_scale(own, peer, alpha=0.5)
    adv = xgrpo_advantages(own, peers, alpha=0.5)
    m = xgrpo_metrics(own, adv, baseline, peer[0])
    # Shifts: row 0: |0.5*0 + 0.5*0.5 - 0| = 0.25; row 1: 0 (no peers);
    # row 2: own mean 0.5, union [1,0,1] mean 2/3 -> |0.25 + 1/3 - 0.5| = 1/12.
    assert m["probe/xgrpo_baseline_shift"] == pytest.approx((0.25 + 0 + 1 / 12) / 3, abs=1e-6)
    assert m["probe/xgrpo_baseline_shift_max"] == pytest.approx(0.25, abs=1e-6)
    # Rows 0 and 1 have zero variance; only row 0 (with peers) got a signal.
    assert m["probe/xgrpo_zero_var_groups"] == 2.0
    assert m["probe/xgrpo_zero_var_signal_share"] == 0.5
    assert m["probe/xgrpo_prompts_with_peers"] == 2.0


def test_invalid_arguments_are_all_reported():
    with pytest.raises(ValueError) as err:
        xgrpo_advantages(torch.zeros(2, 1), [torch.ones(1)] * 2, alpha=1.5, scale_source="peer", eps=0.0)
    msg = str(err.value)
    assert "G >= 2" in msg and "alpha=1.5" in msg and "scale_source='peer'" in msg and "eps=0.0" in msg


def test_nan_peer_reward_is_rejected_unless_masked():
    own = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="peer_rewards holds NaN"):
        xgrpo_advantages(own, torch.tensor([[float("nan")]]), alpha=0.5)
    adv = xgrpo_advantages(own, torch.tensor([[float("nan")]]), alpha=0.5, peer_mask=torch.tensor([[False]]))
    assert torch.isfinite(adv).all()
