"""Correcting for a sampler that is not the trainer: truncated or masked importance weights.

An inference engine such as vLLM samples with its own kernels, precision and batching, so
the probability it gave a sampled token is close to, but not exactly, the probability the
training forward gives it. The update then follows the loop TRL's GRPO trainer uses with
vLLM (``vllm_importance_sampling_correction``, trl 1.16):

1. the trainer's log-probs of every rollout (TRL: a no-grad pass before the update; here
   the first inner iteration's own forward, :class:`SamplerCorrection`) are the "old"
   log-probs of the clipped ratio (so the ratio is exactly 1 on the first inner iteration);
2. each token's surrogate loss is multiplied by an importance weight

       w = exp(logp_trainer - logp_sampler)                       token level
       w = exp(sum_t m_t (logp_trainer - logp_sampler))           sequence level (one w per row)

   and ``w`` is bounded by ``[clip_min, clip_max]``: ``*_truncate`` clamps it into the
   range, ``*_mask`` sets it to 0 outside (TRL's four ``vllm_importance_sampling_mode`` s);
   the KL term is not weighted. Non-finite differences (a token the sampler could not
   score) count as 0 (w = 1), as in TRL.

Logged per policy, as TRL logs them under ``sampling/``: ``rollout/<p>/is_ratio_mean``,
``is_ratio_min``, ``is_ratio_max`` (of the weights applied: over counted tokens at token
level, over rows at sequence level), ``abs_delta_logp`` and ``abs_delta_logp_max``
(``|logp_trainer - logp_sampler|`` over counted tokens, nats). See docs/rollout.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mrl_lightning.metrics import Max, Mean, Min
from mrl_lightning.rollout.options import importance_sampling_errors


def importance_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    completion_mask: Tensor,
    mode: str = "token_truncate",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> Tensor:
    """Bounded importance weights of the trainer's distribution over the sampler's.

    Formula of TRL's ``vllm_importance_sampling_correction`` (trl 1.16, module docstring).

    Args:
        trainer_logp: ``[N, L]`` float32 nats, the trainer's log-probs of the sampled tokens.
        sampler_logp: ``[N, L]`` float32 nats, the sampler's log-probs of the same tokens.
        completion_mask: ``[N, L]`` bool, True = counted.
        mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or ``sequence_mask``.
        clip_max: C_max; None = no upper bound.
        clip_min: C_min; None = no lower bound.

    Returns:
        ``[N, L]`` float32 (token modes) or ``[N, 1]`` float32 (sequence modes), detached.

    Raises:
        ValueError: unknown ``mode``, shapes that differ, or bounds out of range.
    """
    errors = importance_sampling_errors("importance_weights", mode, clip_max, clip_min)
    if errors:
        raise ValueError(" ".join(errors))
    if trainer_logp.shape != sampler_logp.shape or trainer_logp.shape != completion_mask.shape:
        raise ValueError(f"trainer_logp {tuple(trainer_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and "
                         f"completion_mask {tuple(completion_mask.shape)} must all be [N, L].")
    diff = (trainer_logp.detach().float() - sampler_logp.float()) * completion_mask
    diff = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampler_mismatch_metrics(
    policy_name: str, trainer_logp: Tensor, sampler_logp: Tensor, completion_mask: Tensor, weights: Tensor | None
) -> dict[str, float]:
    """``rollout/<p>/abs_delta_logp[_max]`` (nats) and, with weights, ``rollout/<p>/is_ratio_{mean,min,max}``.

    Args:
        policy_name: The policy.
        trainer_logp: ``[N, L]`` float32 nats.
        sampler_logp: ``[N, L]`` float32 nats.
        completion_mask: ``[N, L]`` bool, True = counted.
        weights: ``[N, L]`` or ``[N, 1]`` from :func:`importance_weights`, or None (correction off).

    Returns:
        Scalars; 0 for statistics over an empty set (no counted token).
    """
    p = policy_name
    delta = (trainer_logp.detach().float() - sampler_logp.float()).abs()
    delta = delta[completion_mask & torch.isfinite(delta)]
    out = {f"rollout/{p}/abs_delta_logp": Mean(float(delta.mean()) if delta.numel() else 0.0, delta.numel()),
           f"rollout/{p}/abs_delta_logp_max": Max(float(delta.max()) if delta.numel() else 0.0)}
    if weights is not None:
        flat = weights.flatten() if weights.shape[-1] == 1 else weights[completion_mask]
        out[f"rollout/{p}/is_ratio_mean"] = Mean(float(flat.mean()) if flat.numel() else 0.0, flat.numel())
        out[f"rollout/{p}/is_ratio_min"] = Min(float(flat.min()) if flat.numel() else 0.0)
        out[f"rollout/{p}/is_ratio_max"] = Max(float(flat.max()) if flat.numel() else 0.0)
    return out


class SamplerCorrection:
    """Old log-probs and importance weights from the update's own first forward, a micro-batch at a time.

    The trainer's log-probs of the rollouts are those of the first inner iteration's loss
    forward: it runs at the weights the rollouts are scored under and in the update's
    precision, so its log-probs, detached, are what a separate no-grad pass would give (TRL
    computes the same from a pass of their own). :meth:`take` makes them a micro-batch's old
    log-probs (0 where masked: the clipped ratio is exactly 1) and returns its weights;
    :meth:`finish`, after the last micro-batch, writes them into ``rollouts.old_logprobs`` (the
    later inner iterations' old log-probs) and returns every row's weights and the metrics
    (module docstring). No pass of its own: one forward fewer per update than re-scoring first.

    Args:
        policy: The :class:`~mrl_lightning.policy.PolicyModule` (its ``vllm_importance_sampling_*`` settings).
        rollouts: Its rollouts, with ``sampling_logprobs`` ``[N, L]`` float32 nats.
    """

    def __init__(self, policy, rollouts) -> None:
        self.policy, self.rollouts = policy, rollouts
        self.trainer_logp = torch.zeros_like(rollouts.old_logprobs)
        self.weights: Tensor | None = None

    def take(self, rows: slice, logp: Tensor) -> tuple[Tensor, Tensor | None]:
        """Old log-probs and weights of the micro-batch ``rows`` from its forward's ``[n, L]`` log-probs."""
        policy, mask = self.policy, self.rollouts.completion_mask[rows]
        trainer = torch.where(mask, logp.detach(), torch.zeros_like(logp.detach()))
        self.trainer_logp[rows] = trainer
        if not policy.vllm_importance_sampling_correction:
            return trainer, None
        sampler = self.rollouts.sampling_logprobs[rows].to(trainer.device)
        weights = importance_weights(trainer, sampler, mask, policy.vllm_importance_sampling_mode,
                                     policy.vllm_importance_sampling_clip_max, policy.vllm_importance_sampling_clip_min)
        if self.weights is None:
            self.weights = torch.ones((self.trainer_logp.shape[0], *weights.shape[1:]), dtype=weights.dtype,
                                      device=weights.device)
        self.weights[rows] = weights
        return trainer, weights

    def finish(self) -> tuple[Tensor | None, dict[str, float]]:
        """``(every row's weights or None when the correction is off, metrics)``; the old log-probs set."""
        r = self.rollouts
        r.old_logprobs = self.trainer_logp
        sampler = r.sampling_logprobs.to(self.trainer_logp.device)
        return self.weights, sampler_mismatch_metrics(self.policy.policy_name, self.trainer_logp, sampler,
                                                      r.completion_mask, self.weights)
