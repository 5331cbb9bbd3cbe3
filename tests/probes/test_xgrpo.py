"""XGRPO advantages (docs/probes.md): hand-computed values and the plain-GRPO reduction."""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.exchange import GroupStatsRecord
from mrl_lightning.objectives.grpo import group_advantages
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
    """Plain GRPO, scale_rewards="group": (r - mean) / (std + eps), Bessel std as TRL."""
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


def test_own_scale_with_positive_alpha_is_refused_naming_the_fix():
    # scale_source="own" on an all-fail group: s = std(0, 0, 0, 0) = 0, so with alpha 0.5 and a
    # succeeding peer the advantage would be -0.25 / 1e-4 = -2500. The combination is refused.
    with pytest.raises(ValueError) as err:
        xgrpo_advantages(torch.zeros(1, 4), [torch.ones(4)], alpha=0.5, scale_source="own")
    msg = str(err.value)
    assert "scale_source='own' with alpha=0.5" in msg and "2500" in msg
    assert "scale_source='union'" in msg and "alpha=0" in msg
    with pytest.raises(ValueError, match="scale_source='own' with alpha=1.0"):
        xgrpo_baseline_scale(torch.zeros(1, 4), peer_moments([torch.ones(4)], 1), alpha=1.0, scale_source="own")


@pytest.mark.parametrize("scale_source", ["union", "own"])
def test_alpha_zero_gives_exactly_zero_on_equal_non_binary_groups(scale_source):
    # Eight equal rewards: r - mean is 0 by definition; float32 means of 0.1 / 0.3 / 0.7 are inexact
    # and used to give -7.5e-5 / 3e-4 / 6e-4 once divided by (std + 1e-4). Row 3 has spread.
    own = torch.tensor([[0.1] * 8, [0.3] * 8, [0.7] * 8, [0.1, 0.3, 0.7, 0.1, 0.3, 0.7, 0.1, 0.3]])
    for peers in ([torch.empty(0)] * 4, [torch.tensor([0.0, 1.0, 0.5])] * 4):
        adv = xgrpo_advantages(own, peers, alpha=0.0, scale_source=scale_source)
        assert torch.equal(adv[:3], torch.zeros(3, 8))
        assert (adv[3] != 0).all()
        # Without peers, either scale is plain GRPO bit for bit (the trainer's group_advantages).
        if peers[0].numel() == 0 or scale_source == "own":
            assert torch.equal(adv, group_advantages(own, "group"))


@pytest.mark.parametrize("value", [0.3, 0.7])
def test_equal_group_whose_peers_scored_the_same_gets_exactly_zero_for_any_alpha(value):
    # Own group all `value`; one peer group of 8 x `value` published as (n, float32 mean, std 0);
    # the float32 mean of eight 0.3s (or 0.7s) is not the float32 value itself. The union is
    # sixteen equal rewards: r - mean U = 0 and r - mean R_i = 0, so A = 0 for every alpha.
    own = torch.full((1, 8), value)
    published_mean = float(torch.full((8,), value).mean())
    assert published_mean != float(torch.tensor(value))
    for alpha in (0.25, 1.0):
        adv = xgrpo_advantages_from_stats(own, torch.tensor([[8.0]]), torch.tensor([[published_mean]]),
                                          torch.tensor([[0.0]]), alpha=alpha)
        assert torch.equal(adv, torch.zeros(1, 8))


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


def test_prompt_twice_in_one_batch_gets_peer_stats_on_every_copy():
    # An epoch that wraps inside a batch puts p0 in rows 0 and 2. Both copies are the same
    # prompt, so both must see peer b's group (n 4, mean 0.5, std of [1, 1, 0, 0]).
    records = [GroupStatsRecord("p0", "b", 3, 4, 0.5, math.sqrt(1 / 3), 2),
               GroupStatsRecord("p1", "b", 3, 2, 1.0, 0.0, 2)]
    count, mean, std = peer_stats_from_records(records, ["p0", "p1", "p0"])
    assert count.tolist() == [[4.0], [2.0], [4.0]]
    assert mean.tolist() == [[0.5], [1.0], [0.5]]
    own = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    adv = xgrpo_advantages_from_stats(own, count, mean, std, alpha=0.5)
    # Rows 0 and 2, all fail: union [0, 0, 0, 0, 1, 1, 0, 0], mean 0.25,
    # Bessel var (2 * 0.75^2 + 6 * 0.25^2) / 7 = 1.5 / 7; b = 0.5 * 0 + 0.5 * 0.25 = 0.125.
    a0 = -0.125 / (math.sqrt(1.5 / 7) + EPS)
    assert a0 == pytest.approx(-0.2700, abs=1e-4)
    torch.testing.assert_close(adv[0], torch.full((4,), a0), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv[2], torch.full((4,), a0), rtol=0, atol=1e-6)


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


def test_zero_var_signal_share_does_not_count_float_rounding():
    # Three equal non-binary groups with varied peers, alpha 0: b = own mean, every advantage is 0.
    own = torch.tensor([[0.1] * 8, [0.3] * 8, [0.7] * 8])
    peers = [torch.tensor([0.0, 1.0])] * 3
    peer = peer_moments(peers, 3)
    adv = xgrpo_advantages(own, peers, alpha=0.0)
    baseline, _ = xgrpo_baseline_scale(own, peer, alpha=0.0)
    m = xgrpo_metrics(own, adv, baseline, peer[0])
    assert m["probe/xgrpo_zero_var_groups"] == 3.0
    assert m["probe/xgrpo_zero_var_signal_share"] == 0.0
    assert m["probe/xgrpo_baseline_shift"] == 0.0
    # alpha 0.5: union of eight 0.1s and [0, 1] has mean (0.8 + 1) / 10 = 0.18, a real shift of
    # 0.5 * (0.18 - 0.1) = 0.04 for row 0: every group now gets a signal.
    adv = xgrpo_advantages(own, peers, alpha=0.5)
    baseline, _ = xgrpo_baseline_scale(own, peer, alpha=0.5)
    m = xgrpo_metrics(own, adv, baseline, peer[0])
    assert m["probe/xgrpo_zero_var_signal_share"] == 1.0
    assert baseline[0].item() == pytest.approx(0.14, abs=1e-6)


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
