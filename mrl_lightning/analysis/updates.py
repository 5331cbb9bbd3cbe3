"""Per-probe policy updates on given samples: pure functions of the bandit (docs/bandit.md).

Every function here is deterministic: it receives the samples already drawn (own group,
peer samples as they arrived through THL) and returns the ascent direction on the
receiver's logits table. Randomness lives in :mod:`mrl_lightning.analysis.simulate`.

Conventions shared by all rules:

- ``grad_logits log pi(y | x) = onehot(y) - pi(. | x)`` (tabular softmax).
- Group advantages follow docs/grpo.md ``scale_rewards = "group"`` with TRL's numbers: the
  std is Bessel-corrected and ``eps = 1e-4`` (TRL's ``GRPOTrainer``). A
  zero-variance group therefore gets advantages of exactly 0.
- Aggregation is ``loss_type = "grpo"`` with one-token completions: the mean over the
  sequences of the (possibly pooled) group. The returned update is that per-prompt
  direction for every context at once (the batch-mean gradient times ``N``), so the
  learning rate is per context.

Shapes: ``probs`` ``[..., N, K]`` float64; own ``actions``/``rewards`` ``[..., N, G]``;
peer ones ``[..., N, M]``; rewards in {0, 1}; log-probs in nats. Returned updates are
``[..., N, K]`` float64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mrl_lightning.analysis.bandit import gather_last

ADV_EPS = 1e-4


def group_advantages(rewards: np.ndarray, eps: float = ADV_EPS) -> np.ndarray:
    """docs/grpo.md, ``scale_rewards = "group"``: ``A_k = (r_k - mean(r)) / (std(r) + eps)``.

    Args:
        rewards: ``[..., N, G]`` float64, ``G >= 2``.
        eps: Added to the Bessel-corrected std (TRL uses 1e-4).

    Returns:
        ``[..., N, G]`` float64 advantages.

    Raises:
        ValueError: the group has fewer than 2 samples (its std is undefined).
    """
    if rewards.shape[-1] < 2:
        raise ValueError(f"group size {rewards.shape[-1]} is too small: GRPO needs G >= 2")
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, ddof=1, keepdims=True)
    return (rewards - mean) / (std + eps)


def score_direction(probs: np.ndarray, actions: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """``sum_k coef_k * (onehot(y_k) - pi(. | x))`` for every context.

    Args:
        probs: ``[..., N, K]`` float64, the receiver's current policy.
        actions: ``[..., N, S]`` int64 actions the coefficients refer to.
        coef: ``[..., N, S]`` float64 per-sample coefficients (advantage times weight).

    Returns:
        ``[..., N, K]`` float64.
    """
    lead = np.broadcast_shapes(probs.shape[:-1], actions.shape[:-1], coef.shape[:-1])
    k = probs.shape[-1]
    s = np.broadcast_shapes(actions.shape[-1:], coef.shape[-1:])[0]
    actions = np.broadcast_to(actions, lead + (s,)).reshape(-1, s)
    coef = np.broadcast_to(coef, lead + (s,)).reshape(-1, s)
    rows = actions.shape[0]
    flat = (np.arange(rows)[:, None] * k + actions).ravel()
    scatter = np.bincount(flat, weights=coef.ravel(), minlength=rows * k).reshape(lead + (k,))
    return scatter - coef.sum(axis=-1).reshape(lead)[..., None] * probs


def grpo_update(
    probs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, eps: float = ADV_EPS
) -> np.ndarray:
    """Plain GRPO, the ``none`` probe (docs/bandit.md): ``(1/G) sum_k A_k grad log pi(y_k | x)``.

    Args:
        probs: ``[..., N, K]`` receiver policy.
        actions: ``[..., N, G]`` own samples.
        rewards: ``[..., N, G]`` their rewards.
        eps: Advantage std epsilon.

    Returns:
        ``[..., N, K]`` ascent direction on the logits.

    Raises:
        ValueError: ``G < 2`` (from :func:`group_advantages`).
    """
    adv = group_advantages(rewards, eps)
    return score_direction(probs, actions, adv) / rewards.shape[-1]


def _truncate(rho: np.ndarray, cap: float) -> np.ndarray:
    return np.minimum(rho, cap)


def _clip(rho: np.ndarray, cap: float) -> np.ndarray:
    return np.clip(rho, 1.0 / cap, cap)


def _unweighted(rho: np.ndarray, cap: float) -> np.ndarray:
    return np.ones_like(rho)


IS_MODES: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "truncate": _truncate,
    "clip": _clip,
    "none": _unweighted,
}
"""PRP weight modes (docs/probes.md): ``min(rho, c)``, ``clip(rho, 1/c, c)``, ``1``."""


def importance_weights(
    logp_receiver: np.ndarray, logp_source: np.ndarray, is_mode: str, cap: float
) -> np.ndarray:
    """PRP importance weights (docs/bandit.md), ``rho = exp(logp_receiver - logp_source)`` then the mode.

    The weight multiplies the score term as a constant (no gradient through it), as in
    truncated importance sampling.

    Args:
        logp_receiver: ``[..., N, M]`` nats, receiver's log-prob of each arrived peer action.
        logp_source: ``[..., N, M]`` nats, the source's sampling log-prob carried by the record.
        is_mode: One of ``IS_MODES``: ``"truncate"``, ``"clip"``, ``"none"``.
        cap: ``c > 1``.

    Returns:
        ``[..., N, M]`` float64 weights.

    Raises:
        ValueError: unknown ``is_mode`` or ``cap <= 1``.
    """
    if is_mode not in IS_MODES:
        raise ValueError(f"is_mode={is_mode!r} is unknown; valid: {sorted(IS_MODES)}")
    if not cap > 1.0:
        raise ValueError(f"cap={cap} must be > 1 (it bounds rho to [1/c, c] or below c)")
    rho = np.exp(logp_receiver - logp_source)
    return IS_MODES[is_mode](rho, cap)


def prp_update(
    probs: np.ndarray,
    own_actions: np.ndarray,
    own_rewards: np.ndarray,
    peer_actions: np.ndarray,
    peer_rewards: np.ndarray,
    peer_logp_source: np.ndarray,
    *,
    is_mode: str,
    cap: float,
    lambda_prp: float = 1.0,
    eps: float = ADV_EPS,
) -> np.ndarray:
    """PRP, Peer Rollout Pooling (docs/bandit.md).

    The group for advantages is own ``G`` plus peer ``M``; ``A`` is group-normalized over
    the ``G + M`` rewards. Then

        U = (1 / (G + M)) * [ sum_own A_k grad log pi(y_k)
                              + lambda_prp * sum_peer w_k A_k grad log pi(y~_k) ]

    with ``w_k`` from :func:`importance_weights` on ``rho = pi_i(y~_k) / pi_j(y_k)``
    (``y~`` the action as it arrived, ``pi_j(y_k)`` the source's sampling probability).

    Args:
        probs: ``[..., N, K]`` receiver policy ``pi_i``.
        own_actions: ``[..., N, G]`` receiver's samples.
        own_rewards: ``[..., N, G]`` their rewards.
        peer_actions: ``[..., N, M]`` peer samples as they arrived (after the THL residual).
        peer_rewards: ``[..., N, M]`` rewards the source's verifier gave them.
        peer_logp_source: ``[..., N, M]`` nats, source sampling log-probs.
        is_mode: ``"truncate"``, ``"clip"`` or ``"none"``.
        cap: ``c > 1``.
        lambda_prp: Peer loss weight, >= 0.
        eps: Advantage std epsilon.

    Returns:
        ``[..., N, K]`` ascent direction.

    Raises:
        ValueError: unknown ``is_mode``, ``cap <= 1``, or ``G + M < 2``.
    """
    lead = np.broadcast_shapes(own_rewards.shape[:-1], peer_rewards.shape[:-1])
    g = own_rewards.shape[-1]
    pooled = np.concatenate(
        [np.broadcast_to(own_rewards, lead + (g,)),
         np.broadcast_to(peer_rewards, lead + peer_rewards.shape[-1:])], axis=-1)
    adv = group_advantages(pooled, eps)
    logp_recv = np.log(gather_last(probs, peer_actions))
    w = importance_weights(logp_recv, peer_logp_source, is_mode, cap)
    own = score_direction(probs, own_actions, adv[..., :g])
    peer = score_direction(probs, peer_actions, lambda_prp * w * adv[..., g:])
    return (own + peer) / pooled.shape[-1]


def xgrpo_update(
    probs: np.ndarray,
    own_actions: np.ndarray,
    own_rewards: np.ndarray,
    peer_rewards: np.ndarray,
    *,
    alpha: float,
    scale_source: str = "union",
    eps: float = ADV_EPS,
) -> np.ndarray:
    """XGRPO, Cross-Policy GRPO Advantage Sharing (docs/bandit.md). Own samples only.

        b(x) = (1 - alpha) * mean(R_i(x)) + alpha * mean(union R(x))
        s(x) = std(union R(x))  (or std(R_i(x)) with scale_source = "own")
        U = (1/G) sum_own (r_k - b) / (s + eps) * grad log pi(y_k)

    The union is the receiver's and the peers' rewards together; stds are Bessel-corrected.

    Args:
        probs: ``[..., N, K]`` receiver policy.
        own_actions: ``[..., N, G]`` receiver's samples.
        own_rewards: ``[..., N, G]`` their rewards.
        peer_rewards: ``[..., N, M]`` peers' rewards on the same contexts (scalars only cross).
        alpha: Baseline mixing weight in [0, 1].
        scale_source: ``"union"`` or ``"own"``.
        eps: Std epsilon.

    Returns:
        ``[..., N, K]`` ascent direction.

    Raises:
        ValueError: ``alpha`` outside [0, 1] or unknown ``scale_source``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    if scale_source not in ("union", "own"):
        raise ValueError(f"scale_source={scale_source!r} is unknown; valid: ['own', 'union']")
    lead = np.broadcast_shapes(own_rewards.shape[:-1], peer_rewards.shape[:-1])
    own_b = np.broadcast_to(own_rewards, lead + own_rewards.shape[-1:])
    union = np.concatenate([own_b, np.broadcast_to(peer_rewards, lead + peer_rewards.shape[-1:])], -1)
    base = (1 - alpha) * own_b.mean(-1, keepdims=True) + alpha * union.mean(-1, keepdims=True)
    scale = (union if scale_source == "union" else own_b).std(-1, ddof=1, keepdims=True)
    adv = (own_b - base) / (scale + eps)
    return score_direction(probs, own_actions, adv) / own_rewards.shape[-1]


def sgt_update(
    probs: np.ndarray,
    own_actions: np.ndarray,
    own_rewards: np.ndarray,
    peer_actions_source: np.ndarray,
    peer_actions_arrived: np.ndarray,
    peer_rewards: np.ndarray,
    *,
    lambda_sgt: float,
    a_plus: float = 1.0,
    kappa: float = 0.0,
    max_demos: int = 1,
    success_threshold: float = 1.0,
    eps: float = ADV_EPS,
) -> np.ndarray:
    """SGT, Success-Gated Transfer (docs/bandit.md): GRPO on own samples plus a gated score term.

    Context ``x`` is in the rescue set when the own success rate is ``<= kappa`` and some
    peer sample succeeded (the verifier checked it on the source side). For those, up to
    ``max_demos`` peer successes, deduplicated by source action (the text), in sample order,
    are added as positives with no importance ratio:

        U = grpo_update + lambda_sgt * A_plus * mean_demos grad log pi(y~_d | x)

    where ``y~_d`` is the demo as it arrived (it may have been corrupted by THL).

    Args:
        probs: ``[..., N, K]`` receiver policy.
        own_actions: ``[..., N, G]`` receiver's samples.
        own_rewards: ``[..., N, G]`` their rewards.
        peer_actions_source: ``[..., N, M]`` peer actions as sampled (deduplication key).
        peer_actions_arrived: ``[..., N, M]`` the same after the THL residual.
        peer_rewards: ``[..., N, M]`` peer rewards from the verifier.
        lambda_sgt: Transfer weight, >= 0.
        a_plus: Advantage given to transferred successes (default 1).
        kappa: Own success-rate gate in [0, 1] (0 = rescue only all-fail groups).
        max_demos: ``m >= 1``, demos per rescued context.
        success_threshold: ``tau``: success = reward >= tau.
        eps: Advantage std epsilon for the GRPO part.

    Returns:
        ``[..., N, K]`` ascent direction.

    Raises:
        ValueError: ``max_demos < 1``, ``kappa`` outside [0, 1], or ``G < 2``.
    """
    if max_demos < 1:
        raise ValueError(f"max_demos={max_demos} must be >= 1")
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa={kappa} must be in [0, 1]")
    base = grpo_update(probs, own_actions, own_rewards, eps)
    m = peer_rewards.shape[-1]
    peer_ok = peer_rewards >= success_threshold
    own_rate = (own_rewards >= success_threshold).mean(axis=-1)
    gate = (own_rate <= kappa) & peer_ok.any(axis=-1)
    same = peer_actions_source[..., :, None] == peer_actions_source[..., None, :]
    earlier = np.tril(np.ones((m, m), dtype=bool), -1)  # [k, k'] True when k' < k
    dup = (same & peer_ok[..., None, :] & earlier).any(axis=-1)
    first = peer_ok & ~dup
    keep = first & (np.cumsum(first, axis=-1) <= max_demos)
    n_keep = np.maximum(keep.sum(axis=-1, keepdims=True), 1)
    coef = np.where(keep & gate[..., None], lambda_sgt * a_plus / n_keep, 0.0)
    return base + score_direction(probs, peer_actions_arrived, coef)
