"""KL safety of the GRPO objective (docs/grpo.md): the log-ratio bound and the ratio-weighted k3.

Notation: d = log pi_ref - log pi_theta, rho = exp(log pi_theta - log pi_old),
k3(d) = exp(d) - d - 1. Expected values are worked out by hand below each case.
"""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.objectives.grpo import KL_LOG_RATIO_CLAMP, grpo_loss, k3_kl

LN2 = math.log(2.0)
E20 = math.exp(20.0)  # 485165195.4097903


def _one_token(logp: float, old: float, ref: float, **kw):
    """grpo_loss on one counted token with A = 0, so only the KL term is left."""
    x = torch.tensor([[logp]], requires_grad=True)
    out = grpo_loss(x, torch.tensor([[old]]), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool),
                    loss_type="bnpo", ref_logp=torch.tensor([[ref]]), **kw)
    out.loss.backward()
    return out, x.grad


def test_rare_token_gives_a_finite_loss_and_gradient_with_the_default_bound():
    # logp -120 under the policy (which also sampled it: rho = 1), -0.01 under the reference, beta 0.04.
    # d = 119.99 is bounded to 20: KL = rho * k3(20) = exp(20) - 21 = 485165174.4097903;
    # loss = 0.04 * that = 19406606.976; past the bound the token gets no KL gradient: 0.
    out, grad = _one_token(-120.0, -120.0, -0.01, beta=0.04)
    assert math.isfinite(float(out.loss.detach()))
    assert float(out.loss.detach()) == pytest.approx(0.04 * (E20 - 21.0), rel=1e-6)
    assert torch.equal(grad, torch.zeros(1, 1))
    assert out.kl_clamped.tolist() == [[True]]
    # Without the bound (TRL's plain k3): exp(119.99) overflows float32, the loss is inf.
    unbounded, _ = _one_token(-120.0, -120.0, -0.01, beta=0.04, kl_log_ratio_clamp=None)
    assert float(unbounded.loss.detach()) == math.inf


def test_rare_off_policy_token_stays_finite_without_bias_correction_too():
    # Same token sampled by an older policy at -119 nats: rho = exp(-1) = 0.3678794.
    # Plain k3 (no ratio): loss = 0.04 * (exp(20) - 21) as above, gradient 0.
    out, grad = _one_token(-120.0, -119.0, -0.01, beta=0.04, use_bias_correction_kl=False)
    assert float(out.loss.detach()) == pytest.approx(0.04 * (E20 - 21.0), rel=1e-6)
    assert torch.equal(grad, torch.zeros(1, 1))
    # With the ratio: loss = 0.04 * exp(-1) * (exp(20) - 21) = 7139277.05; still no gradient
    # (the ratio is taken as a constant on a bounded token).
    out, grad = _one_token(-120.0, -119.0, -0.01, beta=0.04)
    assert float(out.loss.detach()) == pytest.approx(0.04 * math.exp(-1.0) * (E20 - 21.0), rel=1e-6)
    assert torch.equal(grad, torch.zeros(1, 1))


def test_k3_bound_by_hand_value_and_gradient():
    # logp = [-25, 25, -ln 2, 0], ref = 0: d = [25, -25, ln 2, 0], bounded to [20, -20, ln 2, 0].
    #   k3(20)   = exp(20) - 21              = 485165174.41
    #   k3(-20)  = exp(-20) + 19             = 19.000000002
    #   k3(ln 2) = 2 - ln 2 - 1              = 0.3068528
    #   k3(0)    = 0
    # d k3 / d logp = -(exp(d) - 1) inside the bound: ln 2 -> -1, 0 -> 0; 0 outside.
    logp = torch.tensor([-25.0, 25.0, -LN2, 0.0], requires_grad=True)
    kl = k3_kl(logp, torch.zeros(4))
    expected = torch.tensor([E20 - 21.0, math.exp(-20.0) + 19.0, 1.0 - LN2, 0.0], dtype=torch.float64)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-6, atol=1e-6)
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -1.0, 0.0]), rtol=0, atol=1e-6)
    assert KL_LOG_RATIO_CLAMP == 20.0


def test_bias_correction_weights_k3_by_the_undetached_ratio():
    # logp = ln 0.5, old = ln 0.25 (rho = 2), ref = 0 (d = ln 2), beta = 1, A = 0, one token.
    # KL = rho * k3(d) = 2 * (1 - ln 2) = 0.6137056.
    # d/d logp (rho k3) = rho k3 + rho (1 - exp(d)) = -rho d = -2 ln 2 = -1.3862944.
    # (A detached ratio would give rho (1 - exp(d)) = -2; plain k3 gives 1 - exp(d) = -1.)
    out, grad = _one_token(-LN2, math.log(0.25), 0.0, beta=1.0)
    assert float(out.loss.detach()) == pytest.approx(2.0 * (1.0 - LN2), abs=1e-6)
    assert float(grad) == pytest.approx(-2.0 * LN2, abs=1e-6)
    plain, plain_grad = _one_token(-LN2, math.log(0.25), 0.0, beta=1.0, use_bias_correction_kl=False)
    assert float(plain.loss.detach()) == pytest.approx(1.0 - LN2, abs=1e-6)
    assert float(plain_grad) == pytest.approx(-1.0, abs=1e-6)


def test_on_policy_bias_corrected_kl_gradient_is_the_log_ratio():
    # rho = 1: d/d logp (rho k3) = -d = logp - ref. logp = -1, ref = -3: d = -2, gradient 2;
    # plain k3: 1 - exp(d) = 1 - exp(-2) = 0.8646647. With beta 0.5: 1.0 and 0.4323324.
    out, grad = _one_token(-1.0, -1.0, -3.0, beta=0.5)
    assert float(grad) == pytest.approx(0.5 * 2.0, abs=1e-6)
    _, plain_grad = _one_token(-1.0, -1.0, -3.0, beta=0.5, use_bias_correction_kl=False)
    assert float(plain_grad) == pytest.approx(0.5 * (1.0 - math.exp(-2.0)), abs=1e-6)


# The running example of test_grpo_loss.py: ratio [[1.5, 0.7, 1.1], [0.5, 5.0 (masked), 1.3]],
# A = [+1, -2], clip [0.8, 1.28], surrogate losses grpo 0.5366667, bnpo/dapo 0.224, dr_grpo 0.14.
# ref = logp + ln 2 on row 0 (k3 = 1 - ln 2 = 0.3068528) and logp - ln 2 on row 1 (ln 2 - 0.5 = 0.1931472).
# Ratio-weighted KL: row 0 = 0.3068528 * (1.5 + 0.7 + 1.1) = 1.0126142 over 3 tokens,
#                    row 1 = 0.1931472 * (0.5 + 1.3)       = 0.3476650 over 2 counted tokens.
# grpo:    0.5366667 + 0.1 * (1.0126142 / 3 + 0.3476650 / 2) / 2 = 0.5366667 + 0.0255685 = 0.5622352
# dapo:    0.224 + 0.1 * (1.0126142 + 0.3476650) / 5 = 0.224 + 0.0272056 = 0.2512056
# dr_grpo: 0.14 + 0.1 * 1.3602792 / (2 * 4) = 0.14 + 0.0170035 = 0.1570035
@pytest.mark.parametrize("loss_type, expected", [("grpo", 0.5622352), ("dapo", 0.2512056), ("bnpo", 0.2512056),
                                                 ("dr_grpo", 0.1570035)])
def test_bias_corrected_kl_on_the_running_example_by_hand(loss_type, expected):
    ratio = torch.tensor([[1.5, 0.7, 1.1], [0.5, 5.0, 1.3]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    logp = (old + ratio.log()).requires_grad_(True)
    ref = logp.detach() + torch.tensor([[LN2], [-LN2]])
    out = grpo_loss(logp, old, torch.tensor([1.0, -2.0]), mask, loss_type=loss_type, epsilon=0.2,
                    epsilon_high=0.28, beta=0.1, ref_logp=ref, max_completion_length=4)
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-6)


def _trl_reference_loss(logp, old, ref, adv, mask, beta, eps_low, eps_high, loss_type, max_len):
    """TRL 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss (token-level IS,
    no vLLM, no masks), rewritten here for comparison: k3 times coef_1 (not detached) when
    ``use_bias_correction_kl``, clipped surrogate, then the loss_type's aggregation."""
    coef_1 = torch.exp(logp - old)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1)) + beta * per_token_kl
    m = mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    return (per_token_loss * m).sum() / (per_token_loss.size(0) * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_bias_corrected_kl_matches_trl_formula_within_1e_6(loss_type):
    g = torch.Generator().manual_seed(7)
    old = -3.0 * torch.rand(6, 5, generator=g)
    logp0 = old + 0.4 * torch.randn(6, 5, generator=g)   # off-policy by up to ~1 nat
    ref = logp0 + 1.5 * torch.randn(6, 5, generator=g)   # |d| well inside the 20-nat bound
    adv = torch.randn(6, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.2
    mask[:, 0] = True
    ours_x = logp0.clone().requires_grad_(True)
    out = grpo_loss(ours_x, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.04,
                    ref_logp=ref, max_completion_length=5)  # defaults: bias correction on, bound 20
    out.loss.backward()
    trl_x = logp0.clone().requires_grad_(True)
    trl = _trl_reference_loss(trl_x, old, ref, adv, mask, 0.04, 0.2, 0.28, loss_type, 5)
    trl.backward()
    assert abs(float(out.loss.detach()) - float(trl.detach())) <= 1e-6
    torch.testing.assert_close(ours_x.grad, trl_x.grad, rtol=0, atol=1e-6)
    assert not out.kl_clamped.any()


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_non_positive_log_ratio_bound_is_rejected_with_the_fix(bad):
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=rf"kl_log_ratio_clamp={bad}.*> 0.*None"):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), beta=0.1, ref_logp=x,
                  kl_log_ratio_clamp=bad)
    with pytest.raises(ValueError, match=rf"kl_log_ratio_clamp={bad}"):
        k3_kl(x, x, log_ratio_clamp=bad)
