"""GRPO objective as pure functions on tensors (SPEC 2).

Shapes: B prompts, G completions per prompt, N = B*G sequences, L completion length.
Log-probs are float32 nats. ``completion_mask`` is True where a token is counted.

Option names and numbers follow TRL's ``GRPOConfig`` (trl 1.16) where the meaning is
the same: ``scale_rewards`` ("group" | "batch" | "none"), ``epsilon`` / ``epsilon_high``,
``beta`` with the k3 KL estimator, ``loss_type`` ("grpo" | "bnpo" | "dr_grpo" | "dapo"),
``max_completion_length``. Departures from TRL, stated once here:

- The std for ``scale_rewards`` uses Bessel's correction and eps = 1e-4, as TRL does.
- A NaN reward (a verifier that could not score) is excluded from its group's
  statistics and gets advantage 0, so it neither poisons the batch nor moves the policy;
  TRL instead ``nansum``s over reward functions. Per-function NaNs are combined with
  nansum (as TRL) in :func:`combine_rewards`; only an all-NaN row stays NaN.
- TRL multiplies the k3 KL by the importance ratio by default
  (``use_bias_correction_kl``); we use plain k3 as written in SPEC 2.
- ``dapo`` normalizes by the number of counted tokens in the whole step batch, which on
  one process equals ``bnpo``; both take an explicit ``num_tokens`` so micro-batches of
  one step share the normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not supported; valid: {list(valid)}")


def combine_rewards(rewards_per_func: Tensor, weights: Tensor | None = None) -> Tensor:
    """Weighted sum over reward functions, ignoring NaN entries (TRL: ``reward_weights``).

    Args:
        rewards_per_func: ``[N, F]`` float32, one column per reward function; NaN = no score.
        weights: ``[F]`` float32 weights; ones if None.

    Returns:
        ``[N]`` float32; NaN only where every function returned NaN.

    Raises:
        ValueError: ``weights`` length differs from the number of functions.
    """
    n_func = rewards_per_func.shape[1]
    if weights is None:
        weights = torch.ones(n_func, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if weights.numel() != n_func:
        raise ValueError(f"reward_weights has {weights.numel()} entries but there are {n_func} reward functions.")
    total = (rewards_per_func * weights).nansum(dim=1)
    all_nan = torch.isnan(rewards_per_func).all(dim=1)
    return torch.where(all_nan, torch.full_like(total, float("nan")), total)


def group_advantages(rewards: Tensor, scale_rewards: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages (SPEC 2; TRL ``scale_rewards``).

    ``A_k = (r_k - mean(r)) / (std + eps)``, std over the group ("group"), over the whole
    batch ("batch"), or no scaling ("none"). NaN rewards are left out of mean and std and
    get advantage 0. A group with identical rewards gets exactly 0 (no NaN).

    Args:
        rewards: ``[B, G]`` float32 rewards (NaN allowed).
        scale_rewards: "group", "batch" or "none".
        eps: Added to the std (TRL uses 1e-4).

    Returns:
        ``[B, G]`` float32 advantages, finite everywhere.

    Raises:
        ValueError: unknown ``scale_rewards`` or ``rewards`` not 2-D.
    """
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G]; got shape {tuple(rewards.shape)}")
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    mean = r.sum(dim=1, keepdim=True) / count
    centered = torch.where(valid, r - mean, torch.zeros_like(r))
    # A group whose valid rewards are all equal gets exactly 0 (float32 means of e.g. 0.9 are inexact).
    big = torch.finfo(r.dtype).max
    hi = torch.where(valid, r, torch.full_like(r, -big)).max(dim=1, keepdim=True).values
    lo = torch.where(valid, r, torch.full_like(r, big)).min(dim=1, keepdim=True).values
    centered = torch.where(hi == lo, torch.zeros_like(centered), centered)
    if scale_rewards == "group":
        var = centered.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        adv = centered / (var.sqrt() + eps)
    elif scale_rewards == "batch":
        n = valid.sum().clamp(min=1)
        flat = torch.where(valid, r, torch.zeros_like(r))
        bmean = flat.sum() / n
        bvar = torch.where(valid, (r - bmean).pow(2), torch.zeros_like(r)).sum() / (n - 1).clamp(min=1)
        adv = centered / (bvar.sqrt() + eps)
    else:
        adv = centered
    return torch.where(valid, adv, torch.zeros_like(adv))


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 KL estimator (SPEC 2; Schulman's k3, TRL ``beta``).

    ``KL_t = exp(ref - logp) - (ref - logp) - 1`` (>= 0).

    Args:
        logp: ``[N, L]`` float32 nats, current policy.
        ref_logp: ``[N, L]`` float32 nats, reference model.

    Returns:
        ``[N, L]`` float32 nats.
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


@dataclass
class PolicyLossOutput:
    """Result of :func:`grpo_loss`.

    Attributes:
        loss: scalar, the aggregated loss (already divided by the step's normalizer).
        per_token_loss: ``[N, L]`` float32 before aggregation.
        ratio: ``[N, L]`` importance ratio exp(logp - old_logp).
        kl: ``[N, L]`` k3 KL in nats, or None when beta == 0.
        clipped_low / clipped_high: ``[N, L]`` bool, tokens where the clip was active.
    """

    loss: Tensor
    per_token_loss: Tensor
    ratio: Tensor
    kl: Tensor | None
    clipped_low: Tensor
    clipped_high: Tensor


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate with optional k3 KL, aggregated by ``loss_type`` (SPEC 2).

    ``l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + beta KL_t``.
    Aggregation over counted tokens (mask m):

    - ``grpo``: mean over each sequence's tokens, then sum / ``num_sequences``
    - ``bnpo`` / ``dapo``: sum over tokens / ``num_tokens``
    - ``dr_grpo``: sum over tokens / (``num_sequences`` * ``max_completion_length``)

    ``num_sequences`` and ``num_tokens`` default to this batch's own counts; pass the
    whole step's counts when the step is split into micro-batches so that the sum of
    micro-batch losses equals the full-batch loss.

    Args:
        logp: ``[N, L]`` float32 nats under the current policy (requires grad).
        old_logp: ``[N, L]`` float32 nats under the sampling policy.
        advantages: ``[N]`` or ``[N, L]`` float32.
        completion_mask: ``[N, L]`` bool, True = counted.
        loss_type: "grpo", "bnpo", "dr_grpo" or "dapo" (TRL ``loss_type``).
        epsilon: Lower clip (TRL ``epsilon``).
        epsilon_high: Upper clip; defaults to ``epsilon`` (TRL ``epsilon_high``).
        beta: KL weight; 0 disables the KL term (TRL ``beta``).
        ref_logp: ``[N, L]`` reference log-probs; required when ``beta > 0``.
        max_completion_length: Required for ``dr_grpo``.
        num_sequences: Normalizer for grpo / dr_grpo.
        num_tokens: Normalizer for bnpo / dapo.

    Returns:
        :class:`PolicyLossOutput`.

    Raises:
        ValueError: unknown ``loss_type``; ``beta > 0`` without ``ref_logp``;
            ``dr_grpo`` without ``max_completion_length``; shape mismatch.
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    if logp.shape != old_logp.shape or logp.shape != completion_mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and completion_mask "
            f"{tuple(completion_mask.shape)} must all be [N, L]."
        )
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs); set beta: 0.0 to disable KL.")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length.")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages

    ratio = torch.exp(logp - old_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    kl = None
    if beta > 0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl

    loss = aggregate_loss(per_token, completion_mask, loss_type, max_completion_length, num_sequences, num_tokens)

    is_low = (ratio < 1.0 - epsilon) & (adv < 0)
    is_high = (ratio > 1.0 + eps_high) & (adv > 0)
    return PolicyLossOutput(loss, per_token, ratio, kl, is_low & completion_mask, is_high & completion_mask)


def aggregate_loss(
    per_token: Tensor,
    completion_mask: Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """Reduce ``[N, L]`` per-token losses to a scalar by ``loss_type`` (SPEC 2; TRL names).

    ``grpo``: per-sequence mean over counted tokens, summed, / ``num_sequences``;
    ``bnpo`` / ``dapo``: sum / ``num_tokens``; ``dr_grpo``: sum / (``num_sequences`` *
    ``max_completion_length``, default L). Normalizers default to this batch's own counts.

    Args:
        per_token: ``[N, L]`` float32.
        completion_mask: ``[N, L]`` bool, True = counted.
        loss_type: "grpo", "bnpo", "dr_grpo" or "dapo".
        max_completion_length: dr_grpo's length normalizer.
        num_sequences: Sequence normalizer (grpo, dr_grpo).
        num_tokens: Token normalizer (bnpo, dapo).

    Raises:
        ValueError: unknown ``loss_type``.
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    mask = completion_mask.to(per_token.dtype)
    n_seq = per_token.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":
        seq_len = mask.sum(dim=1).clamp(min=1.0)
        return ((per_token * mask).sum(dim=1) / seq_len).sum() / max(n_seq, 1)
    if loss_type in ("bnpo", "dapo"):
        n_tok = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token.dtype)
        return (per_token * mask).sum() / torch.clamp(n_tok, min=1.0)
    length = per_token.shape[1] if max_completion_length is None else max_completion_length
    return (per_token * mask).sum() / (max(n_seq, 1) * length)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is True; 0 when nothing is counted.

    Args:
        values: ``[N, L]`` float.
        mask: ``[N, L]`` bool, True = counted.
    """
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)
