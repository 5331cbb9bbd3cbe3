"""XGRPO: Cross-Policy GRPO Advantage Sharing, as pure tensor functions (``docs/probes.md``).

The receiver i trains on its own rollouts only; peers contribute scalars (their groups'
reward statistics). For prompt x with own rewards R_i(x) (G values) and the union
U(x) = R_i(x) plus every peer's rewards on x:

    b_i(x) = (1 - alpha) * mean(R_i(x)) + alpha * mean(U(x))
    s_i(x) = std(U(x))            scale_source = "union"
    s_i(x) = std(R_i(x))          scale_source = "own"  (only with alpha = 0, see below)
    A_ik   = (r_ik - b_i(x)) / (s_i(x) + eps)

Choices this module makes (the method leaves them open):

- std is Bessel-corrected (as TRL's GRPO, ``scale_rewards="group"``); eps defaults to
  TRL's 1e-4.
- The numerator is computed as ``(1 - alpha) * (r - mean R_i) + alpha * (r - mean U)``
  with ``r - mean R_i`` taken from :func:`~mrl_lightning.objectives.grpo.center_groups`,
  the same function plain GRPO uses. So ``alpha = 0`` gives plain GRPO's numerator to the
  last bit, a group of equal own rewards (0.1, 0.3, 0.7 ...) gets exactly 0 from it, and
  ``alpha = 0, scale_source = "own"`` (or a prompt without peer data) is exactly plain
  GRPO. Where the own rewards are all equal to v and ``|v - mean U| <= REWARD_ATOL`` the
  union term is 0 too: peers that scored the same as the receiver give no signal, not
  the float rounding of their published means divided by ``eps``.
- ``scale_source = "own"`` is refused with ``alpha > 0``: on an own group of equal rewards
  (all fail, all succeed: the groups XGRPO exists for) the own std is 0, so the baseline
  shift would be divided by eps alone (0.25 / 1e-4 = 2,500).
- mean(U) pools samples (count-weighted), it is not a mean of per-policy means.
- Peer statistics may arrive as raw rewards (ragged list or padded tensor with a mask) or
  as group statistics (n, mean, Bessel std) from ``GroupStatsRecord``; both give the same
  union moments (pooled exactly with Chan's formula, in float64).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from mrl_lightning.exchange.records import GroupStatsRecord
from mrl_lightning.objectives.grpo import center_groups

SCALE_SOURCES = ("union", "own")
# Reward units: an own group of equal rewards v whose union mean is within this of v gets
# no union term. Float32 rounding of means of rewards in [0, 1] is ~1e-7; verifiers'
# reward steps are far coarser than 1e-6.
REWARD_ATOL = 1e-6


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
    elif scale_source == "own" and alpha > 0:
        problems.append(own_scale_problem(alpha))
    if not eps > 0:
        problems.append(f"eps={eps!r} must be > 0")
    if problems:
        raise ValueError("xgrpo: " + "; ".join(problems))


def own_scale_problem(alpha: float) -> str:
    """Why ``scale_source="own"`` is refused with ``alpha > 0``, and the fix (one sentence)."""
    return (f"scale_source='own' with alpha={alpha!r} > 0 divides the baseline shift by eps alone on an own group "
            "of equal rewards (own std 0; e.g. 0.25 / 1e-4 = 2500 for an all-fail group whose peers half succeed); "
            "use scale_source='union', or alpha=0 for plain GRPO")


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

    Row b holds every record of prompt ``prompt_ids[b]``; a prompt id that appears in several
    rows (an epoch that wraps inside one batch) gets the same records in each of them.
    Records for prompts not in ``prompt_ids`` are ignored; K is the most records any prompt
    has (at least 1). Absent slots have count 0.

    Args:
        records: Peer group statistics (the caller picks which: staleness, one per peer).
        prompt_ids: The B prompt ids of the batch's rows, in row order; repeats allowed.

    Returns:
        ``(count, mean, std)``, each ``[B, K]`` float64 (count in rewards, mean and std in
        reward units), for :func:`peer_moments_from_stats`.
    """
    index: dict[str, list[int]] = {}
    for b, pid in enumerate(prompt_ids):
        index.setdefault(pid, []).append(b)
    rows: list[list[GroupStatsRecord]] = [[] for _ in prompt_ids]
    for rec in records:
        for b in index.get(rec.prompt_id, ()):
            rows[b].append(rec)
    k = max([1] + [len(r) for r in rows])
    count, mean, std = (torch.zeros(len(prompt_ids), k, dtype=torch.float64) for _ in range(3))
    for b, row in enumerate(rows):
        for j, rec in enumerate(row):
            count[b, j], mean[b, j], std[b, j] = rec.n, rec.reward_mean, rec.reward_std
    return count, mean, std


def xgrpo_from_moments(
    own_rewards: Tensor,
    peer: tuple[Tensor, Tensor, Tensor],
    alpha: float,
    scale_source: str = "union",
    eps: float = 1e-4,
) -> tuple[Tensor, Tensor, Tensor]:
    """Advantages, baseline b_i(x) and scale s_i(x) from own rewards and peer moments.

    ``A = ((1 - alpha) (r - mean R_i) + alpha (r - mean U)) / (s + eps)`` (``docs/probes.md``),
    with the exact-zero rules of the module docstring. A prompt without peer data gets
    plain GRPO: b = mean R_i, s = std R_i, the same numbers as
    :func:`~mrl_lightning.objectives.grpo.group_advantages`.

    Args:
        own_rewards: ``[B, G]`` float, the receiver's rewards (finite).
        peer: ``(n, s1, s2)``, each ``[B]`` float64, from :func:`peer_moments` or
            :func:`peer_moments_from_stats`.
        alpha: Weight of the union mean in the baseline, in [0, 1].
        scale_source: ``"union"`` or ``"own"`` (``"own"`` only with ``alpha = 0``).
        eps: Added to the scale, > 0.

    Returns:
        ``(advantages [B, G], baseline [B], scale [B])`` in ``own_rewards.dtype``, reward
        units for baseline and scale.

    Raises:
        ValueError: bad shape, non-finite own rewards, ``alpha`` outside [0, 1], unknown
            ``scale_source``, ``scale_source="own"`` with ``alpha > 0``, ``eps <= 0``.
    """
    _check(own_rewards, alpha, scale_source, eps)
    dtype = own_rewards.dtype
    own_mean, centered, own_std = center_groups(own_rewards)
    n_p, s1_p, s2_p = peer
    has_peer = n_p > 0
    own64 = own_rewards.double()
    n = own_rewards.shape[1] + n_p
    union_mean64 = (own64.sum(1) + s1_p) / n
    m2 = ((own64 * own64).sum(1) + s2_p - n * union_mean64 * union_mean64).clamp_min(0.0)
    union_std = (m2 / (n - 1)).sqrt().to(dtype)

    union_term = own64 - union_mean64[:, None]
    equal_own = (own_rewards == own_rewards[:, :1]).all(dim=1)
    same_as_peers = equal_own & ((own64[:, 0] - union_mean64).abs() <= REWARD_ATOL)
    union_term = torch.where(same_as_peers[:, None], torch.zeros_like(union_term), union_term).to(dtype)
    if alpha == 0:
        numerator = centered
    else:
        numerator = (1.0 - alpha) * centered + alpha * union_term
    numerator = torch.where(has_peer[:, None], numerator, centered)

    baseline = (1.0 - alpha) * own_mean[:, 0] + alpha * union_mean64.to(dtype)
    baseline = torch.where(has_peer, baseline, own_mean[:, 0])
    scale = own_std[:, 0] if scale_source == "own" else torch.where(has_peer, union_std, own_std[:, 0])
    return numerator / (scale[:, None] + eps), baseline, scale


def xgrpo_baseline_scale(
    own_rewards: Tensor,
    peer: tuple[Tensor, Tensor, Tensor],
    alpha: float,
    scale_source: str = "union",
) -> tuple[Tensor, Tensor]:
    """Baseline b_i(x) and scale s_i(x) (``docs/probes.md``) from own rewards and peer moments.

    Args:
        own_rewards: ``[B, G]`` float, the receiver's rewards.
        peer: ``(n, s1, s2)`` from :func:`peer_moments` or :func:`peer_moments_from_stats`.
        alpha: Weight of the union mean in the baseline, in [0, 1].
        scale_source: ``"union"`` or ``"own"`` (``"own"`` only with ``alpha = 0``).

    Returns:
        ``(b, s)``, each ``[B]`` in ``own_rewards.dtype``, reward units.

    Raises:
        ValueError: as :func:`xgrpo_from_moments`.
    """
    _, baseline, scale = xgrpo_from_moments(own_rewards, peer, alpha, scale_source)
    return baseline, scale


def xgrpo_advantages(
    own_rewards: Tensor,
    peer_rewards: Sequence[Tensor] | Tensor,
    alpha: float,
    scale_source: str = "union",
    eps: float = 1e-4,
    peer_mask: Tensor | None = None,
) -> Tensor:
    """XGRPO advantages A_ik = (r_ik - b_i(x)) / (s_i(x) + eps) (``docs/probes.md``).

    Args:
        own_rewards: ``[B, G]`` float, rewards of the receiver's own completions.
        peer_rewards: Peers' rewards per prompt: a list of B tensors ``[G_b]`` (ragged,
            may be empty) or a padded ``[B, M]`` tensor with ``peer_mask``.
        alpha: Weight of the union mean in the baseline, in [0, 1]; 0 = own mean.
        scale_source: ``"union"`` (std of own + peer rewards) or ``"own"`` (std of own;
            only with ``alpha = 0``, where it is plain GRPO).
        eps: Added to the scale (TRL's default 1e-4).
        peer_mask: ``[B, M]`` bool, True = present; only with a padded tensor.

    Returns:
        ``[B, G]`` advantages, ``own_rewards.dtype``; no gradient flows to peers.

    Raises:
        ValueError: bad shapes, NaN/inf rewards, ``alpha``/``scale_source``/``eps`` invalid,
            ``scale_source="own"`` with ``alpha > 0``.
    """
    _check(own_rewards, alpha, scale_source, eps)
    peer = peer_moments(peer_rewards, own_rewards.shape[0], peer_mask)
    return xgrpo_from_moments(own_rewards, peer, alpha, scale_source, eps)[0]


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
    return xgrpo_from_moments(own_rewards, peer, alpha, scale_source, eps)[0]


def xgrpo_metrics(own_rewards: Tensor, advantages: Tensor, baseline: Tensor, peer_count: Tensor) -> dict[str, float]:
    """What XGRPO did to one batch, under ``probe/`` (``docs/probes.md``).

    Args:
        own_rewards: ``[B, G]`` own rewards.
        advantages: ``[B, G]`` XGRPO advantages.
        baseline: ``[B]`` b_i(x) (from :func:`xgrpo_from_moments`).
        peer_count: ``[B]`` number of peer rewards per prompt (``peer_moments(...)[0]``).

    Returns:
        ``probe/xgrpo_baseline_shift`` (mean over prompts of |b_i - mean R_i|, reward units),
        ``probe/xgrpo_baseline_shift_max``, ``probe/xgrpo_zero_var_groups`` (own groups with
        all rewards equal), ``probe/xgrpo_zero_var_signal_share`` (share of those given a
        non-zero advantage; XGRPO gives such a group exactly 0 unless its baseline moved by
        more than float rounding; 0 when there are none), ``probe/xgrpo_prompts_with_peers``.
    """
    own_mean = center_groups(own_rewards)[0][:, 0]
    shift = (baseline - own_mean).abs()
    zero_var = (own_rewards == own_rewards[:, :1]).all(dim=1)
    signal = (advantages != 0).any(dim=1)
    n_zero = int(zero_var.sum())
    return {
        "probe/xgrpo_baseline_shift": float(shift.mean()) if shift.numel() else 0.0,
        "probe/xgrpo_baseline_shift_max": float(shift.max()) if shift.numel() else 0.0,
        "probe/xgrpo_zero_var_groups": float(n_zero),
        "probe/xgrpo_zero_var_signal_share": float((zero_var & signal).sum()) / n_zero if n_zero else 0.0,
        "probe/xgrpo_prompts_with_peers": float((peer_count > 0).sum()),
    }
