"""GRPO clipped surrogate, k3 KL and loss_type aggregation (docs/grpo.md), values worked out by hand.

The running example is N = 2 sequences x L = 3 tokens with epsilon = 0.2 and
epsilon_high = 0.28, so the ratio is clipped to [0.8, 1.28]:

    ratio   = [[1.5, 0.7, 1.1],      A = +1
               [0.5, 5.0, 1.3]]      A = -2
    mask    = [[1,   1,   1  ],
               [1,   0,   1  ]]      (the ratio 5.0 token is not counted)

Per token l = -min(rho A, clip(rho) A):

    [0,0] rho 1.5 > 1.28, A > 0: -min(1.5, 1.28)       = -1.28   (clipped high)
    [0,1] rho 0.7 < 0.8,  A > 0: -min(0.7, 0.8)        = -0.70   (not clipped: min keeps rho)
    [0,2] rho 1.1:               -1.1                  = -1.10
    [1,0] rho 0.5 < 0.8,  A < 0: -min(-1.0, -1.6)      = +1.60   (clipped low)
    [1,1] rho 5.0 (masked):      -min(-10, -2.56)      = +10.0   (must not count)
    [1,2] rho 1.3 > 1.28, A < 0: -min(-2.6, -2.56)     = +2.60   (not clipped: min keeps rho)

Counted sums: row 0 = -3.08 over 3 tokens, row 1 = 4.2 over 2 tokens; all = 1.12 over 5.
"""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.objectives.grpo import grpo_loss, k3_kl, masked_mean

LN2 = math.log(2.0)
RATIO = torch.tensor([[1.5, 0.7, 1.1], [0.5, 5.0, 1.3]])
MASK = torch.tensor([[True, True, True], [True, False, True]])
ADV = torch.tensor([1.0, -2.0])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]])
CLIP = dict(epsilon=0.2, epsilon_high=0.28)


def _logp():
    return (OLD + RATIO.log()).clone().requires_grad_(True)


# loss_type -> (loss, d loss / d logp) by hand.
# grpo:    (-3.08 / 3 + 4.2 / 2) / 2 = (-1.0266667 + 2.1) / 2 = 0.5366667
# bnpo:    1.12 / 5 = 0.224;  dapo: the same normalizer on one process
# dr_grpo: 1.12 / (2 sequences * max_completion_length 4) = 0.14
# Gradient: d(-rho A)/d logp = -rho A where the unclipped branch is taken, 0 where the
# clipped (constant) branch is taken or the token is masked; then the normalizer:
#   grpo  row 0 / (3 * 2), row 1 / (2 * 2); bnpo/dapo / 5; dr_grpo / 8.
EXPECTED = {
    "grpo": (0.5366667, [[0.0, -0.7 / 6, -1.1 / 6], [0.0, 0.0, 2.6 / 4]]),
    "bnpo": (0.224, [[0.0, -0.7 / 5, -1.1 / 5], [0.0, 0.0, 2.6 / 5]]),
    "dapo": (0.224, [[0.0, -0.7 / 5, -1.1 / 5], [0.0, 0.0, 2.6 / 5]]),
    "dr_grpo": (0.14, [[0.0, -0.7 / 8, -1.1 / 8], [0.0, 0.0, 2.6 / 8]]),
}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_clipped_surrogate_matches_hand_computed_loss_and_gradient(loss_type):
    logp = _logp()
    out = grpo_loss(logp, OLD, ADV, MASK, loss_type=loss_type, max_completion_length=4, **CLIP)
    loss, grad = EXPECTED[loss_type]
    assert float(out.loss.detach()) == pytest.approx(loss, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad), rtol=0, atol=1e-6)


def test_per_token_loss_and_clip_flags_by_hand():
    out = grpo_loss(_logp(), OLD, ADV, MASK, loss_type="dapo", **CLIP)
    expected = torch.tensor([[-1.28, -0.7, -1.1], [1.6, 10.0, 2.6]])
    torch.testing.assert_close(out.per_token_loss.detach(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.ratio.detach(), RATIO, rtol=0, atol=1e-6)
    # Clipped high only where rho > 1.28 with A > 0; low only where rho < 0.8 with A < 0.
    assert out.clipped_high.tolist() == [[True, False, False], [False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, False], [True, False, False]]
    assert out.kl is None


def test_epsilon_high_defaults_to_epsilon():
    # With epsilon_high = epsilon = 0.2 the clip is [0.8, 1.2]:
    #   [0,0] -min(1.5, 1.2) = -1.2;  [1,2] -min(-2.6, -2.4) = 2.6 (unchanged)
    # dapo: (-1.2 - 0.7 - 1.1 + 1.6 + 2.6) / 5 = 1.2 / 5 = 0.24
    out = grpo_loss(_logp(), OLD, ADV, MASK, loss_type="dapo", epsilon=0.2)
    assert float(out.loss.detach()) == pytest.approx(0.24, abs=1e-6)


def test_explicit_normalizers_replace_the_batch_counts():
    # A micro-batch of a bigger step: normalizers are the step's, not this slice's.
    # dapo / bnpo: 1.12 / 10 = 0.112
    # grpo: (-1.0266667 + 2.1) / 4 sequences = 0.2683333
    # dr_grpo: 1.12 / (4 sequences * 4) = 0.07
    kw = dict(max_completion_length=4, num_sequences=4, num_tokens=10.0, **CLIP)
    for loss_type, expected in (("dapo", 0.112), ("bnpo", 0.112), ("grpo", 0.2683333), ("dr_grpo", 0.07)):
        out = grpo_loss(_logp(), OLD, ADV, MASK, loss_type=loss_type, **kw)
        assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-6), loss_type


def test_per_token_advantages_broadcast_like_per_sequence_ones():
    # [N, L] advantages equal to the row's value give the same loss as [N].
    adv_tok = ADV.unsqueeze(1).expand(2, 3).clone()
    out = grpo_loss(_logp(), OLD, adv_tok, MASK, loss_type="grpo", **CLIP)
    assert float(out.loss.detach()) == pytest.approx(0.5366667, abs=1e-6)


def test_k3_kl_by_hand():
    # KL_t = exp(d) - d - 1 with d = ref - logp:
    #   d = ln 0.25 - ln 0.5 = -ln 2: 0.5 + ln 2 - 1 = 0.1931472
    #   d = 0 - ln 0.5       = +ln 2: 2 - ln 2 - 1   = 0.3068528
    #   d = 0:                          1 - 0 - 1    = 0
    logp = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    ref = torch.log(torch.tensor([0.25, 1.0, 0.5]))
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([0.1931472, 0.3068528, 0.0]), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        # KL per token: row 0 (ref = logp + ln 2) 1 - ln 2 = 0.3068528;
        #               row 1 (ref = logp - ln 2) ln 2 - 0.5 = 0.1931472.
        # Counted KL sum = 3 (1 - ln 2) + 2 (ln 2 - 0.5) = 2 - ln 2 = 1.3068528; beta = 0.1.
        # grpo: 0.5366667 + 0.1 * (0.3068528 + 0.1931472) / 2 = 0.5366667 + 0.025 = 0.5616667
        ("grpo", 0.5616667),
        # dapo: 0.224 + 0.1 * 1.3068528 / 5 = 0.224 + 0.0261371 = 0.2501371
        ("dapo", 0.2501371),
        ("bnpo", 0.2501371),
        # dr_grpo: 0.14 + 0.1 * 1.3068528 / 8 = 0.14 + 0.0163357 = 0.1563357
        ("dr_grpo", 0.1563357),
    ],
)
def test_beta_weighted_k3_kl_adds_to_the_surrogate(loss_type, expected):
    logp = _logp()
    ref = logp.detach() + torch.tensor([[LN2], [-LN2]])
    # Plain k3 (the ratio-weighted default is worked out in test_grpo_kl_safety.py).
    out = grpo_loss(logp, OLD, ADV, MASK, loss_type=loss_type, beta=0.1, ref_logp=ref, max_completion_length=4,
                    use_bias_correction_kl=False, **CLIP)
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(
        out.kl.detach(), torch.tensor([[1 - LN2] * 3, [LN2 - 0.5] * 3]), rtol=0, atol=1e-6
    )


def test_invalid_options_raise_with_the_valid_choices():
    logp = _logp()
    with pytest.raises(ValueError, match=r"loss_type='ppo'.*grpo.*bnpo.*dr_grpo.*dapo"):
        grpo_loss(logp, OLD, ADV, MASK, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, OLD, ADV, MASK, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logp, OLD, ADV, MASK, loss_type="dr_grpo")
    with pytest.raises(ValueError, match=r"\[N, L\]"):
        grpo_loss(logp, OLD[:, :2], ADV, MASK)


def test_masked_mean_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, False, True]])
    # (1 + 3 + 6) / 3 = 3.3333333
    assert float(masked_mean(values, mask)) == pytest.approx(10 / 3, abs=1e-6)
    assert float(masked_mean(values, torch.zeros_like(mask))) == 0.0
