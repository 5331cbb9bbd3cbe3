"""XGRPO: Cross-Policy GRPO Advantage Sharing, as pure tensor functions (SPEC 3.3).

The receiver i trains on its own rollouts only; peers contribute scalars (their groups'
reward statistics). For prompt x with own rewards R_i(x) (G values) and the union
U(x) = R_i(x) plus every peer's rewards on x:

    b_i(x) = (1 - alpha) * mean(R_i(x)) + alpha * mean(U(x))
    s_i(x) = std(U(x))            scale_source = "union"
    s_i(x) = std(R_i(x))          scale_source = "own"
    A_ik   = (r_ik - b_i(x)) / (s_i(x) + eps)

Choices this module makes (SPEC leaves them open):

- std is Bessel-corrected (``torch.std``'s default, as TRL's GRPO, ``scale_rewards="group"``);
  eps defaults to TRL's 1e-4. With ``alpha = 0`` and ``scale_source = "own"`` the result is
  exactly plain GRPO group advantages (r - mean) / (std + eps) (SPEC 2).
- mean(U) pools samples (count-weighted), it is not a mean of per-policy means.
- Peer statistics may arrive as raw rewards (ragged list or padded tensor with a mask) or
  as group statistics (n, mean, Bessel std) from ``GroupStatsRecord``; both give the same
  union moments (pooled exactly with Chan's formula, in float64).
- A prompt without peer data gets b = mean(R_i), and s = std(R_i): plain GRPO.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from mrl_lightning.exchange.records import GroupStatsRecord

SCALE_SOURCES = ("union", "own")
# |A| above this counts as "a signal" for the zero-variance metric (float rounding in b).
SIGNAL_ATOL = 1e-6


def _check(own_rewards: Tensor, alpha: float, scale_source: str, eps: float) -> None:
    problems = []
    if own_rewards.dim() != 2 or own_rewards.shape[1] < 2:
        problems.append(f"own_rewards must be [B, G] with G >= 2, got shape {tuple(own_rewards.shape)}")
    elif not torch.isfinite(own_rewards).all():
        problems.append("own_rewards holds NaN/inf; drop unscored completions before XGRPO")
    if not 0.0 <= alpha <= 1.0:
        problems.append(f"alpha={alpha!r} must be in [0, 1]")
    if scale_source not in SCALE_SOURCES:
        problems.append(f"scale_source={scale_source!r} is not valid; valid: {list(SCALE_SOURCES)}")
    if not eps > 0:
        problems.append(f"eps={eps!r} must be > 0")
    if problems:
        raise ValueError("xgrpo: " + "; ".join(problems))


def peer_moments(
    peer_rewards: Sequence[Tensor] | Tensor, batch_size: int, peer_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-prompt count, sum and sum of squares of peer rewards.

    Args:
        peer_rewards: Either a list of ``batch_size`` tensors, entry b being ``[G_b]`` (all
            peers' rewards on prompt b, possibly empty), or a padded ``[B, M]`` float tensor.
        batch_size: B.
        peer_mask: ``[B, M]`` bool, True = the peer reward is present. Only with a padded
            tensor; ``None`` means every entry is present.

    Returns:
        ``(n, s1, s2)``, each ``[B]`` float64: count, sum and sum of squares.

    Raises:
        ValueError: wrong length or shape, a mask with a list, or NaN/inf among counted
            rewards.
    """
    if isinstance(peer_rewards, Tensor):
        if peer_rewards.dim() != 2 or peer_rewards.shape[0] != batch_size:
            raise ValueError(
                f"peer_rewards must be [B={batch_size}, M], got shape {tuple(peer_rewards.shape)}"
            )
        mask = torch.ones_like(peer_rewards, dtype=torch.bool) if peer_mask is None else peer_mask
        if mask.shape != peer_rewards.shape or mask.dtype != torch.bool:
            raise ValueError(
                f"peer_mask must be bool of shape {tuple(peer_rewards.shape)}, got "
                f"{mask.dtype} {tuple(mask.shape)}"
            )
        values = peer_rewards.double()
        if not torch.isfinite(values[mask]).all():
            raise ValueError("peer_rewards holds NaN/inf where peer_mask is True; mask them out")
        values = torch.where(mask, values, torch.zeros_like(values))
        return mask.double().sum(1), values.sum(1), (values * values).sum(1)
    if peer_mask is not None:
        raise ValueError("peer_mask is only valid with a padded [B, M] peer_rewards tensor, not a list")
    if len(peer_rewards) != batch_size:
        raise ValueError(f"peer_rewards has {len(peer_rewards)} entries, expected B={batch_size}")
    n, s1, s2 = (torch.zeros(batch_size, dtype=torch.float64) for _ in range(3))
    for b, r in enumerate(peer_rewards):
        r = torch.as_tensor(r, dtype=torch.float64).reshape(-1)
        if not torch.isfinite(r).all():
            raise ValueError(f"peer_rewards[{b}] holds NaN/inf; drop unscored completions")
        n[b], s1[b], s2[b] = r.numel(), r.sum(), (r * r).sum()
    return n, s1, s2


def peer_moments_from_stats(count: Tensor, mean: Tensor, std: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Same as :func:`peer_moments` from per-peer group statistics (``GroupStatsRecord``).

    Args:
        count: ``[B, K]`` number of rewards in peer k's group on prompt b (0 = absent).
        mean: ``[B, K]`` that group's mean reward.
        std: ``[B, K]`` its Bessel-corrected std (ignored where count <= 1; may be NaN there).

    Returns:
        ``(n, s1, s2)``, each ``[B]`` float64, exact: s2 = sum_k (n_k - 1) std_k^2 + n_k mean_k^2.

    Raises:
        ValueError: shapes differ or a count is negative.
    """
    if not (count.shape == mean.shape == std.shape) or count.dim() != 2:
        raise ValueError(
            f"count, mean, std must share one [B, K] shape, got {tuple(count.shape)}, "
            f"{tuple(mean.shape)}, {tuple(std.shape)}"
        )
    n = count.double()
    if (n < 0).any():
        raise ValueError("count holds negative values")
    present = n > 0
    mu = torch.where(present, mean.double(), torch.zeros_like(n))
    m2 = torch.where(n > 1, (n - 1) * std.double() ** 2, torch.zeros_like(n))
    return n.sum(1), (n * mu).sum(1), (m2 + n * mu * mu).sum(1)


def peer_stats_from_records(
    records: Iterable[GroupStatsRecord], prompt_ids: Sequence[str]
) -> tuple[Tensor, Tensor, Tensor]:
    """Pack ``GroupStatsRecord`` s into padded ``[B, K]`` (count, mean, std) for these prompts.

    Records for prompts not in ``prompt_ids`` are ignored; K is the most records any prompt
    has (at least 1). Absent slots have count 0.
    """
    index = {pid: b for b, pid in enumerate(prompt_ids)}
    rows: list[list[GroupStatsRecord]] = [[] for _ in prompt_ids]
    for rec in records:
        if rec.prompt_id in index:
            rows[index[rec.prompt_id]].append(rec)
    k = max([1] + [len(r) for r in rows])
    count, mean, std = (torch.zeros(len(prompt_ids), k, dtype=torch.float64) for _ in range(3))
    for b, row in enumerate(rows):
        for j, rec in enumerate(row):
            count[b, j], mean[b, j], std[b, j] = rec.n, rec.reward_mean, rec.reward_std
    return count, mean, std


def xgrpo_baseline_scale(
    own_rewards: Tensor,
    peer: tuple[Tensor, Tensor, Tensor],
    alpha: float,
    scale_source: str = "union",
) -> tuple[Tensor, Tensor]:
    """Baseline b_i(x) and scale s_i(x) of SPEC 3.3 from own rewards and peer moments.

    Args:
        own_rewards: ``[B, G]`` float, the receiver's rewards.
        peer: ``(n, s1, s2)`` from :func:`peer_moments` or :func:`peer_moments_from_stats`.
        alpha: Weight of the union mean in the baseline, in [0, 1].
        scale_source: ``"union"`` or ``"own"``.

    Returns:
        ``(b, s)``, each ``[B]`` in ``own_rewards.dtype``.

    Raises:
        ValueError: bad shape, non-finite own rewards, ``alpha`` outside [0, 1], unknown
            ``scale_source``.
    """
    _check(own_rewards, alpha, scale_source, 1.0)
    own_mean = own_rewards.mean(dim=1)
    own_std = own_rewards.std(dim=1)  # Bessel, as TRL
    n_p, s1_p, s2_p = peer
    own64 = own_rewards.double()
    n = own_rewards.shape[1] + n_p
    s1 = own64.sum(1) + s1_p
    union_mean64 = s1 / n
    m2 = ((own64 * own64).sum(1) + s2_p - n * union_mean64 * union_mean64).clamp_min(0.0)
    union_std = (m2 / (n - 1)).sqrt().to(own_rewards.dtype)
    union_mean = union_mean64.to(own_rewards.dtype)
    baseline = (1.0 - alpha) * own_mean + alpha * union_mean
    scale = union_std if scale_source == "union" else own_std
    return baseline, scale


def xgrpo_advantages(
    own_rewards: Tensor,
    peer_rewards: Sequence[Tensor] | Tensor,
    alpha: float,
    scale_source: str = "union",
    eps: float = 1e-4,
    peer_mask: Tensor | None = None,
) -> Tensor:
    """XGRPO advantages A_ik = (r_ik - b_i(x)) / (s_i(x) + eps) (SPEC 3.3).

    Args:
        own_rewards: ``[B, G]`` float, rewards of the receiver's own completions.
        peer_rewards: Peers' rewards per prompt: a list of B tensors ``[G_b]`` (ragged,
            may be empty) or a padded ``[B, M]`` tensor with ``peer_mask``.
        alpha: Weight of the union mean in the baseline, in [0, 1]; 0 = own mean.
        scale_source: ``"union"`` (std of own + peer rewards) or ``"own"`` (std of own).
        eps: Added to the scale (TRL's default 1e-4).
        peer_mask: ``[B, M]`` bool, True = present; only with a padded tensor.

    Returns:
        ``[B, G]`` advantages, ``own_rewards.dtype``; no gradient flows to peers.

    Raises:
        ValueError: bad shapes, NaN/inf rewards, ``alpha``/``scale_source``/``eps`` invalid.
    """
    _check(own_rewards, alpha, scale_source, eps)
    peer = peer_moments(peer_rewards, own_rewards.shape[0], peer_mask)
    baseline, scale = xgrpo_baseline_scale(own_rewards, peer, alpha, scale_source)
    return (own_rewards - baseline[:, None]) / (scale[:, None] + eps)


def xgrpo_advantages_from_stats(
    own_rewards: Tensor,
    peer_count: Tensor,
    peer_mean: Tensor,
    peer_std: Tensor,
    alpha: float,
    scale_source: str = "union",
    eps: float = 1e-4,
) -> Tensor:
    """:func:`xgrpo_advantages` from peers' group statistics ``[B, K]`` (see
    :func:`peer_moments_from_stats`); what a receiver gets from ``GroupStatsRecord`` s.

    Raises:
        ValueError: as :func:`xgrpo_advantages` and :func:`peer_moments_from_stats`.
    """
    _check(own_rewards, alpha, scale_source, eps)
    if peer_count.shape[0] != own_rewards.shape[0]:
        raise ValueError(f"peer_count has {peer_count.shape[0]} rows, expected B={own_rewards.shape[0]}")
    peer = peer_moments_from_stats(peer_count, peer_mean, peer_std)
    baseline, scale = xgrpo_baseline_scale(own_rewards, peer, alpha, scale_source)
    return (own_rewards - baseline[:, None]) / (scale[:, None] + eps)


def xgrpo_metrics(own_rewards: Tensor, advantages: Tensor, baseline: Tensor, peer_count: Tensor) -> dict[str, float]:
    """What XGRPO did to one batch, under ``probe/`` (SPEC 3.3 "Logged").

    Args:
        own_rewards: ``[B, G]`` own rewards.
        advantages: ``[B, G]`` XGRPO advantages.
        baseline: ``[B]`` b_i(x) (from :func:`xgrpo_baseline_scale`).
        peer_count: ``[B]`` number of peer rewards per prompt (``peer_moments(...)[0]``).

    Returns:
        ``probe/xgrpo_baseline_shift`` (mean over prompts of |b_i - mean R_i|, reward units),
        ``probe/xgrpo_baseline_shift_max``, ``probe/xgrpo_zero_var_groups`` (own groups with
        all rewards equal), ``probe/xgrpo_zero_var_signal_share`` (share of those with some
        |A| > 1e-6; 0 when there are none), ``probe/xgrpo_prompts_with_peers``.
    """
    shift = (baseline - own_rewards.mean(dim=1)).abs()
    zero_var = (own_rewards == own_rewards[:, :1]).all(dim=1)
    signal = (advantages.abs() > SIGNAL_ATOL).any(dim=1)
    n_zero = int(zero_var.sum())
    return {
        "probe/xgrpo_baseline_shift": float(shift.mean()) if shift.numel() else 0.0,
        "probe/xgrpo_baseline_shift_max": float(shift.max()) if shift.numel() else 0.0,
        "probe/xgrpo_zero_var_groups": float(n_zero),
        "probe/xgrpo_zero_var_signal_share": float((zero_var & signal).sum()) / n_zero if n_zero else 0.0,
        "probe/xgrpo_prompts_with_peers": float((peer_count > 0).sum()),
    }
