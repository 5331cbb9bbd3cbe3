"""Masks on the policy term: high-entropy tokens and off-policy sequences (docs/grpo.md, "Masks on the policy term").

Both multiply the per-token policy term only (not the KL term), as TRL 1.16's
``GRPOTrainer._compute_loss`` applies them:

- ``top_entropy_quantile`` rho (Beyond the 80/20 Rule): only tokens whose entropy is at or
  above the ``1 - rho`` quantile of the counted tokens' entropies keep their policy term;
- ``off_policy_mask_threshold`` delta (Off-Policy Sequence Masking, DeepSeek-V3.2): a sequence
  with a negative advantage whose mean ``log pi_sampler - log pi_theta`` over its counted tokens
  exceeds delta is dropped.

Shapes: N sequences, L completion length; entropies and log-probs float32 nats;
``completion_mask`` ``[N, L]`` bool, True = counted.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_threshold(counted_entropies: Tensor, top_entropy_quantile: float) -> Tensor | None:
    """The entropy at the ``1 - top_entropy_quantile`` quantile (linear interpolation, ``torch.quantile``).

    Args:
        counted_entropies: ``[K]`` float32 nats, the entropy of every counted token of the
            batch (a data-parallel group gathers every rank's before calling this).
        top_entropy_quantile: rho in [0, 1] (TRL ``top_entropy_quantile``).

    Returns:
        ``[]`` float32 nats, or None when there is no counted token (then no token is kept).

    Raises:
        ValueError: ``top_entropy_quantile`` outside [0, 1].
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} must be in [0, 1].")
    if counted_entropies.numel() == 0:
        return None
    return torch.quantile(counted_entropies.float(), 1.0 - top_entropy_quantile)


def high_entropy_mask(entropies: Tensor, completion_mask: Tensor, threshold: Tensor | None) -> Tensor:
    """``[N, L]`` bool: counted tokens whose entropy is >= ``threshold`` (TRL's ``get_high_entropy_mask``).

    Args:
        entropies: ``[N, L]`` float32 nats.
        completion_mask: ``[N, L]`` bool, True = counted.
        threshold: From :func:`entropy_threshold`; None = no token kept.
    """
    if threshold is None:
        return torch.zeros_like(completion_mask, dtype=torch.bool)
    return ((entropies * completion_mask.float()) >= threshold) & completion_mask


def off_policy_sequence_mask(advantages: Tensor, logp: Tensor, sampling_logp: Tensor, completion_mask: Tensor,
                             threshold: float) -> Tensor:
    """``[N, 1]`` float32: 1 = keep, 0 = drop (Off-Policy Sequence Masking; TRL ``off_policy_mask_threshold``).

    A sequence is kept when its advantage is >= 0 or the mean over its counted tokens of
    ``log pi_sampler - log pi_theta`` (NaN read as 0: a token the sampler could not score) is
    <= ``threshold``.

    Args:
        advantages: ``[N, 1]`` (or ``[N, L]``) float32.
        logp: ``[N, L]`` float32 nats under the current policy (detached here).
        sampling_logp: ``[N, L]`` float32 nats under the sampler (the inference engine's when
            another engine sampled, else the old log-probs).
        completion_mask: ``[N, L]`` bool, True = counted.
        threshold: delta, > 0 nats.
    """
    mask = completion_mask.to(logp.dtype)
    kl = torch.nan_to_num(sampling_logp.to(logp.dtype) - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(logp.dtype)
