"""The loss-type registry leaves the four original loss types' numbers bit for bit as they were (docs/grpo.md).

``_before`` is the token-level clipped surrogate + k3 KL + aggregation exactly as
:func:`grpo_loss` computed it before the GRPO family was added (the same torch operations
in the same order). The refactored :func:`grpo_loss` must give the identical loss,
per-token losses and gradient (``torch.equal``, not a tolerance) for ``grpo``, ``bnpo``,
``dr_grpo`` and ``dapo`` (the embedded default's), with and without the KL term, the
bias correction, the bound and sampler weights.
"""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.objectives.grpo import grpo_loss, k3_kl


def _before(logp, old_logp, advantages, mask, loss_type, epsilon, epsilon_high, beta, ref_logp, max_len, n_seq,
            n_tok, bias, clamp, sampler_weights):
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    if sampler_weights is not None:
        per_token = per_token * sampler_weights.detach().to(per_token.dtype)
    if beta > 0:
        kl = k3_kl(logp, ref_logp, clamp)
        kl_clamped = torch.zeros_like(mask) if clamp is None else (ref_logp - logp).detach().abs() > clamp
        if bias:
            kl = kl * torch.where(kl_clamped, ratio.detach(), ratio)
        per_token = per_token + beta * kl
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        seq_len = m.sum(dim=1).clamp(min=1.0)
        return ((per_token * m).sum(dim=1) / seq_len).sum() / max(n_seq, 1), per_token
    if loss_type in ("bnpo", "dapo"):
        return (per_token * m).sum() / torch.clamp(torch.as_tensor(n_tok, dtype=per_token.dtype), min=1.0), per_token
    return (per_token * m).sum() / (max(n_seq, 1) * max_len), per_token


@pytest.mark.parametrize("beta, bias, clamp", [(0.0, True, 20.0), (0.04, True, 20.0), (0.04, False, None),
                                               (0.1, True, 0.3)])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_original_loss_types_are_bit_identical_to_before_the_registry(loss_type, beta, bias, clamp, weights):
    gen = torch.Generator().manual_seed(3)
    n, length = 12, 7
    base = -3 * torch.rand(n, length, generator=gen)
    old = base + 0.4 * torch.randn(n, length, generator=gen)
    ref = base + torch.randn(n, length, generator=gen)
    adv = torch.randn(n, generator=gen)
    mask = torch.arange(length).unsqueeze(0) < torch.randint(1, length + 1, (n, 1), generator=gen)
    sampler = torch.rand(n, length, generator=gen) * 2 if weights else None
    args = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, ref_logp=ref,
                max_completion_length=9, num_sequences=n + 3, num_tokens=float(mask.sum()) + 5.0,
                use_bias_correction_kl=bias, kl_log_ratio_clamp=clamp, sampler_weights=sampler)
    a = base.clone().requires_grad_(True)
    new = grpo_loss(a, old, adv, mask, **args)
    new.loss.backward()
    b = base.clone().requires_grad_(True)
    loss, per_token = _before(b, old, adv, mask, loss_type, 0.2, 0.28, beta, ref, 9, n + 3,
                              float(mask.sum()) + 5.0, bias, clamp, sampler)
    loss.backward()
    assert torch.equal(new.loss.detach(), loss.detach())
    assert torch.equal(new.per_token_loss.detach(), per_token.detach())
    assert torch.equal(a.grad, b.grad)
    assert a.grad.abs().sum() > 0
