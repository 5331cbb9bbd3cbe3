"""What the update's GRPO term needs besides the loss itself (docs/grpo.md, "Masks on the policy term", "Logged").

- :func:`top_entropy_mask`: ``top_entropy_quantile``'s token mask, from a no-grad pass over
  the iteration's micro-batches and a quantile over the policy's whole group of ranks;
- :func:`note_loss_stats` / :func:`loss_stat_metrics`: the loss type's statistics (TRL's
  names: ``cispo_clip_ratio``, ``vespo/phi_seq_mean``) and the off-policy mask's share, as
  metrics that combine over micro-batches and ranks by their unit (tokens or sequences);
- :func:`zero_gradients`: a rank with no GRPO rows (dynamic sampling) holds a zero gradient.

Shapes: N sequences on this rank, L completion length.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from mrl_lightning.metrics import Mean
from mrl_lightning.objectives.grpo import masked_mean
from mrl_lightning.objectives.masks import entropy_threshold, high_entropy_mask


def top_entropy_mask(policy, rollouts, mask: Tensor, model, gather: Callable | None) -> Tensor | None:
    """``[N, L]`` bool, the tokens whose policy term counts under ``top_entropy_quantile`` < 1, else None.

    The entropies come from a no-grad pass of the iteration's policy run one prompt's group at
    a time, on the group's own width (its prompt's left padding and the columns after its
    longest completion cut off), so a token's entropy is the same float whatever the
    micro-batch split and whichever rank holds the group: the G completions of a prompt tie
    on their first tokens, and a tie the quantile lands on must not be split by rounding. The
    quantile is taken over the counted tokens of the policy's whole group of ranks
    (``gather``), so any split and any number of ranks keep the same tokens (docs/grpo.md;
    TRL takes it per micro-batch, over its processes).

    Args:
        policy: The :class:`~mrl_lightning.policy.PolicyModule` (``top_entropy_quantile``,
            ``num_generations``, its log-prob forward).
        rollouts: The batch's :class:`~mrl_lightning.rollout.base.RolloutBatch`, prompt-major (row = b*G + g).
        mask: ``[N, L]`` bool, the counted tokens (truncated completions masked as the loss masks them).
        model: The module to score with (the Fabric-wrapped policy model).
        gather: An object from every rank of the policy's group as a list; None = one rank.
    """
    if policy.top_entropy_quantile >= 1.0:
        return None
    r, g = rollouts, policy.num_generations
    device = r.completion_ids.device
    ent = torch.zeros(mask.shape, device=device)
    with torch.no_grad():
        for start in range(0, r.completion_ids.shape[0], g):
            rows = slice(start, start + g)
            prompt = r.prompt_mask[rows].any(dim=0)
            width = int(r.completion_mask[rows].sum(dim=1).max())
            if width:
                _, part = policy.completion_logprobs(
                    r.prompt_ids[rows][:, prompt], r.prompt_mask[rows][:, prompt], r.completion_ids[rows, :width],
                    r.completion_mask[rows, :width], model=model, with_entropy=True)
                ent[rows, :width] = part
    mask = mask.to(device)
    counted = ent[mask].cpu()
    pooled = torch.cat(gather(counted)) if gather is not None else counted
    return high_entropy_mask(ent, mask, entropy_threshold(pooled, policy.top_entropy_quantile))


def zero_gradients(params: list[torch.nn.Parameter]) -> None:
    """Give every parameter without a gradient a zero one (a rank or step with no GRPO rows)."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def note_loss_stats(stats: dict[str, list[float]], out, mask: Tensor, share: float) -> None:
    """Add one micro-batch's loss-type statistics and policy-term masks to ``stats`` (tag -> ``[sum, count]``).

    A ``[m, L]`` statistic is a share of counted tokens (``share`` of this rank's tokens are in
    this micro-batch), an ``[m, 1]`` one a mean over sequences (TRL's ``global_masked_mean`` of a
    per-sequence value). Token-level clip ratios are left to the update's own sums.
    """
    values = dict(out.stats)
    if out.off_policy_mask is not None:
        values["off_policy_masked_share"] = 1.0 - out.off_policy_mask
    for key, value in values.items():
        rows = value.shape[-1] == 1
        if key.startswith("clip_ratio_") and not rows:
            continue
        part = stats.setdefault(key, [0.0, 0.0])
        if rows:
            part[0], part[1] = part[0] + float(value.float().sum()), part[1] + value.shape[0]
        else:
            part[0] += float(masked_mean(value.float(), mask)) * share
            part[1] = -1.0  # token-weighted: the tag's weight is the rank's counted tokens


def finish_loss_metrics(metrics: dict[str, float], stats: dict[str, list[float]], prefix: str, tokens: float,
                        has_clip: bool) -> None:
    """Put :func:`note_loss_stats`' sums into ``metrics`` (weighted by tokens or sequences over the group's
    ranks); a loss type without a clip (cispo, sapo, vespo) logs no ``clip_ratio_*``, as TRL."""
    if not has_clip:
        for key in ("clip_ratio_low", "clip_ratio_high"):
            metrics.pop(prefix + key, None)
    for key, (total, count) in stats.items():
        metrics[prefix + key] = Mean(total, tokens) if count < 0 else Mean(total / max(count, 1.0), count)
