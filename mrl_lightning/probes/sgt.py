"""SGT, Success-Gated Transfer, as pure functions (SPEC 3.4).

Rescue set of receiver i: prompts where i's own group success rate <= kappa and some
peer has a verified SuccessRecord for the same prompt. For each rescue prompt up to m
peer successes, deduplicated by text, are retokenized into i's tokens (THL) and trained
on as positive samples:

    L_sgt = -lambda_sgt * A_plus * mean_demos( mean_t log p_theta_i(y~_t | x, y~_<t) )

a score direction toward the verified success with no importance ratio. This
project's reading of the paper, stated once: the per-demo token mean is averaged over
the step's demos (not summed), so lambda_sgt sets the transfer's weight independently
of how many prompts are rescued; log p is the temperature-scaled policy, as in the
GRPO term.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def rescue_set(
    own_success: Tensor,
    prompt_ids: Sequence[str],
    peer_successes: dict[str, list[str]],
    kappa: float = 0.0,
    max_per_prompt: int = 1,
) -> dict[int, list[str]]:
    """Which prompts get which peer successes (SPEC 3.4).

    Args:
        own_success: ``[B, G]`` bool, the receiver's own successes.
        prompt_ids: B prompt ids, row order of ``own_success``.
        peer_successes: prompt id -> verified peer success texts, preferred first.
        kappa: A prompt is eligible when its own success rate <= kappa.
        max_per_prompt: m, at most this many distinct texts per prompt.

    Returns:
        Row index b -> up to m distinct texts, only for eligible prompts with a peer success.

    Raises:
        ValueError: shape mismatch, kappa outside [0, 1] or max_per_prompt < 1.
    """
    if own_success.dim() != 2 or own_success.shape[0] != len(prompt_ids):
        raise ValueError(f"own_success must be [B, G] with B = len(prompt_ids) = {len(prompt_ids)}; "
                         f"got {tuple(own_success.shape)}.")
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa={kappa} must be in [0, 1].")
    if max_per_prompt < 1:
        raise ValueError(f"max_per_prompt={max_per_prompt} must be >= 1.")
    rate = own_success.float().mean(dim=1)
    out: dict[int, list[str]] = {}
    seen_prompts: set[str] = set()
    for b, pid in enumerate(prompt_ids):
        if rate[b] > kappa or pid in seen_prompts:
            continue  # a prompt drawn twice in one step is rescued once
        texts = list(dict.fromkeys(peer_successes.get(pid, [])))[:max_per_prompt]
        if texts:
            out[b] = texts
            seen_prompts.add(pid)
    return out


def sgt_loss(logp: Tensor, completion_mask: Tensor, lambda_sgt: float, advantage_plus: float = 1.0) -> Tensor:
    """``lambda * A_plus * mean over demos of the per-demo mean token NLL`` (SPEC 3.4).

    Args:
        logp: ``[M, L]`` float32 nats, receiver log-probs of the retokenized demos.
        completion_mask: ``[M, L]`` bool, True = a demo token (EOS included).
        lambda_sgt: Transfer weight lambda.
        advantage_plus: A_plus, the positive advantage given to a verified success.

    Returns:
        Scalar loss (0 when M == 0).
    """
    if logp.numel() == 0:
        return logp.sum() * 0.0
    mask = completion_mask.to(logp.dtype)
    per_demo = -(logp * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return lambda_sgt * advantage_plus * per_demo.mean()


def pad_demos(demos: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Tensor, ...]:
    """Left-pad prompts and right-pad completions of ``(prompt_ids, completion_ids)`` pairs.

    Returns:
        ``(prompt_ids [M, P], prompt_mask [M, P], completion_ids [M, L], completion_mask [M, L])``.
    """
    from mrl_lightning.rollout import left_pad

    p_ids, p_mask = left_pad([p for p, _ in demos], pad_id)
    width = max(len(c) for _, c in demos)
    c_ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(demos), width), dtype=torch.bool)
    for i, (_, c) in enumerate(demos):
        c_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, : len(c)] = True
    return p_ids, p_mask, c_ids, c_mask
