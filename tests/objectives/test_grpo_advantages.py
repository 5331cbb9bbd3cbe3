"""Group advantages and reward combination (docs/grpo.md; TRL GRPOConfig ``scale_rewards``).

TRL 1.16 (grpo_trainer): ``mean`` per group; ``std`` per group ("group") or over the
whole batch ("batch"), both with Bessel's correction (``Tensor.std``); advantages
``(r - group mean) / (std + 1e-4)``, and plain ``r - group mean`` for "none". Every
expected number below is worked out by hand from those formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.objectives.grpo import combine_rewards, group_advantages, grpo_loss

NAN = float("nan")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_with_identical_rewards_gets_exactly_zero_advantage_and_no_nan(scale):
    # Row 0 all succeed, row 1 all fail: r - mean = 0 exactly, std = 0, 0 / (0 + 1e-4) = 0.
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, scale)
    assert torch.equal(adv, torch.zeros(2, 4))
    # A zero-variance group next to a mixed one stays exactly zero in every mode
    # ("batch" has a non-zero std here, so a wrong centering would show).
    mixed = torch.tensor([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 1.0, 0.0]])
    adv = group_advantages(mixed, scale)
    assert torch.equal(adv[0], torch.zeros(4))
    assert torch.isfinite(adv).all() and (adv[1] != 0).all()


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_with_identical_fractional_rewards_gets_exactly_zero_advantage(scale):
    # Partial-credit or weighted rewards: eight completions all scored 0.9 (and a G = 3 group at 0.9).
    assert torch.equal(group_advantages(torch.full((1, 8), 0.9), scale), torch.zeros(1, 8))
    assert torch.equal(group_advantages(torch.full((1, 3), 0.9), scale), torch.zeros(1, 3))


REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def test_group_scaling_matches_trl_numbers():
    # Group 0: mean 0.5, Bessel var = 4 * 0.25 / 3 = 1/3, std = 0.5773503;
    #   A = +-0.5 / 0.5774503 = +-0.8658754
    # Group 1: mean 0.75, squares 3 * 0.0625 + 0.5625 = 0.75, var = 0.25, std = 0.5;
    #   A = 0.25 / 0.5001 = 0.4999000, -0.75 / 0.5001 = -1.4997001
    expected = torch.tensor(
        [[0.8658754, -0.8658754, -0.8658754, 0.8658754], [0.4999000, 0.4999000, 0.4999000, -1.4997001]]
    )
    torch.testing.assert_close(group_advantages(REWARDS, "group"), expected, rtol=0, atol=1e-6)


def test_batch_scaling_uses_group_mean_and_batch_std_like_trl():
    # Batch of 8: mean 5/8 = 0.625; squares 5 * 0.375^2 + 3 * 0.625^2 = 0.703125 + 1.171875 = 1.875;
    # Bessel var = 1.875 / 7 = 0.2678571, std = 0.5175492, + 1e-4 = 0.5176492.
    # Centered by the GROUP mean (TRL): group 0 +-0.5, group 1 0.25 / -0.75.
    #   0.5 / 0.5176492 = 0.9659052;  0.25 / 0.5176492 = 0.4829526;  0.75 / 0.5176492 = 1.4488577
    expected = torch.tensor(
        [[0.9659052, -0.9659052, -0.9659052, 0.9659052], [0.4829526, 0.4829526, 0.4829526, -1.4488577]]
    )
    torch.testing.assert_close(group_advantages(REWARDS, "batch"), expected, rtol=0, atol=1e-6)


def test_no_scaling_is_reward_minus_group_mean():
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    torch.testing.assert_close(group_advantages(REWARDS, "none"), expected, rtol=0, atol=1e-7)


def test_eps_is_added_to_the_std():
    # Same group 1 with eps = 0.5: 0.25 / (0.5 + 0.5) = 0.25, -0.75 / 1.0 = -0.75
    adv = group_advantages(REWARDS[1:], "group", eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.25, 0.25, -0.75]]), rtol=0, atol=1e-7)


NAN_REWARDS = torch.tensor([[1.0, 0.0, NAN, 1.0], [0.0, 1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "scale, expected",
    [
        # Group 0 without its NaN is [1, 0, 1]: mean 2/3, Bessel var = (2/9 + 4/9) / 2 = 1/3,
        # std 0.5773503 -> 1/3 / 0.5774503 = 0.5772503, -2/3 / 0.5774503 = -1.1545006.
        # Group 1 is untouched by the NaN: +-0.5 / 0.5774503 = +-0.8658754.
        ("group", [[0.5772503, -1.1545006, 0.0, 0.5772503], [-0.8658754, 0.8658754, 0.8658754, -0.8658754]]),
        # Batch std over the 7 scored rewards (four 1s, three 0s): mean 4/7,
        # squares 4 * 9/49 + 3 * 16/49 = 84/49 = 12/7, var = 12/7 / 6 = 2/7, std 0.5345225 (+1e-4).
        #   1/3 / 0.5346225 = 0.6234929;  2/3 / 0.5346225 = 1.2469858;  0.5 / 0.5346225 = 0.9352394
        ("batch", [[0.6234929, -1.2469858, 0.0, 0.6234929], [-0.9352394, 0.9352394, 0.9352394, -0.9352394]]),
        ("none", [[1 / 3, -2 / 3, 0.0, 1 / 3], [-0.5, 0.5, 0.5, -0.5]]),
    ],
)
def test_nan_reward_gets_zero_advantage_and_does_not_poison_the_batch(scale, expected):
    adv = group_advantages(NAN_REWARDS, scale)
    assert torch.isfinite(adv).all()
    assert adv[0, 2] == 0.0
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)


def test_nan_row_advantages_equal_those_of_the_group_without_it():
    # The three scored completions of group 0 get the advantages of a G = 3 group [1, 0, 1]:
    # 0.5772503, -1.1545006, 0.5772503 (see above), whatever the NaN row was.
    alone = torch.tensor([[0.5772503, -1.1545006, 0.5772503]])
    adv = group_advantages(NAN_REWARDS, "group")
    torch.testing.assert_close(adv[:, [0, 1, 3]][:1], alone, rtol=0, atol=1e-6)


def test_all_nan_group_gets_zero_advantage():
    rewards = torch.tensor([[NAN, NAN, NAN], [1.0, 0.0, 0.0]])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, scale)
        assert torch.equal(adv[0], torch.zeros(3)), scale
        assert torch.isfinite(adv).all()


def test_combine_rewards_nansums_over_functions_and_keeps_all_nan_rows_nan():
    per_func = torch.tensor([[1.0, NAN], [NAN, NAN], [0.5, 0.25], [NAN, 0.5]])
    # weights [1, 2]: 1*1 + (NaN skipped) = 1; all NaN -> NaN; 0.5 + 2*0.25 = 1.0; 2*0.5 = 1.0
    out = combine_rewards(per_func, torch.tensor([1.0, 2.0]))
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 1.0 and out[3] == 1.0
    # default weights are ones: 1, NaN, 0.75, 0.5
    out = combine_rewards(per_func)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 0.75 and out[3] == 0.5
    with pytest.raises(ValueError, match="3 entries but there are 2"):
        combine_rewards(per_func, torch.tensor([1.0, 1.0, 1.0]))


def test_unscored_completion_gives_finite_loss_and_no_gradient_on_its_row():
    # Row 2 (prompt 0, completion 2): every reward function returned NaN.
    per_func = torch.tensor([[1.0, 0.0], [0.0, 0.0], [NAN, NAN], [1.0, NAN], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0],
                             [0.0, NAN]])
    rewards = combine_rewards(per_func).view(2, 4)  # [[1, 0, NaN, 1], [0, 2, 1, 0]]
    adv = group_advantages(rewards, "group").view(8)
    assert torch.isfinite(adv).all() and adv[2] == 0.0
    logp = torch.full((8, 3), -1.0, requires_grad=True)
    mask = torch.ones(8, 3, dtype=torch.bool)
    out = grpo_loss(logp, logp.detach(), adv, mask, loss_type="dapo", beta=0.1, ref_logp=torch.full((8, 3), -1.2))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    # With A = 0 the surrogate adds nothing; only the KL term (same for every row) moves row 2.
    # Default use_bias_correction_kl: KL = rho * k3(d), d = ref - logp = -0.2, rho = 1 on-policy;
    # d/d logp = rho * k3 + rho * (1 - exp(d)) = -d = 0.2, so the gradient is 0.1 * 0.2 / 24.
    kl_grad = 0.1 * 0.2 / 24
    torch.testing.assert_close(logp.grad[2], torch.full((3,), kl_grad), rtol=0, atol=1e-7)
    assert (logp.grad[0] != logp.grad[2]).all()


@pytest.mark.parametrize("bad", ["Group", "std", ""])
def test_unknown_scale_rewards_lists_valid_choices(bad):
    with pytest.raises(ValueError, match=r"scale_rewards=.*valid: \['group', 'batch', 'none'\]"):
        group_advantages(REWARDS, bad)


def test_rewards_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_advantages(REWARDS.view(8), "group")
