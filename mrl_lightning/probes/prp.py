"""PRP: Peer Rollout Pooling, as pure tensor functions (docs/probes.md).

Receiver i pools up to M peer rollouts per prompt (already retokenized into i's tokens by
THL) with its own G. Advantages use the pooled group of G + M rewards (docs/grpo.md formulas).
Peer samples are off-policy, so their surrogate carries an importance weight.

Objective for a peer token t (decoupled PPO, Hilton et al. 2021, "Batch size-invariance
for policy optimization"): with

    w_t   = f(exp(logp_recv(t) - logp_src(t)))           importance weight, no gradient
    r_t   = exp(logp_theta(t) - logp_recv(t))            ratio to the receiver at compose time
    l_t   = w_t * policy_t(r, A)

where ``policy_t`` is the receiver's own ``loss_type`` term (docs/grpo.md, "Loss types";
:mod:`mrl_lightning.objectives.loss_types`) with ``logp_recv`` in the place of the old
log-probs and the receiver's ``importance_sampling_level`` for r: for the clipped types
``-min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)`` (``delta`` capping r), for ``cispo``
``-sg(min(r_t, eps_high)) A logp_theta(t)``, for ``sapo`` the sigmoid gate of r, for
``vespo`` ``-sg(phi(R)) A logp_theta(t)`` with R the sequence's ratio to the receiver. Every
one of them is a function of the proximal ratio r that the behaviour weight w multiplies as a
constant, which is the decoupled form (w corrects logp_src -> logp_recv, the loss type's own
clip, cap, gate or phi logp_recv -> logp_theta).

where ``logp_recv`` are i's log-probs of the peer tokens when the batch was composed (the
"old" log-probs i would have had, had it sampled them), ``logp_src`` are j's sampling
log-probs mapped onto i's tokens by THL, and f is the weight mode: ``truncate`` min(rho, c),
``clip`` clamp(rho, 1/c, c), ``none`` 1. At ``is_level="sequence"`` rho is the product over
the sequence's counted tokens (sum of log-ratios) and one weight covers the sequence.

Consequence (tested for every loss type): when i and j are the same policy with the same
tokenizer, logp_recv == logp_src, every weight is exactly 1, and l_t is the policy's own-sample
token loss with the pooled advantages: PRP equals GRPO with a group of G + M.

Combining with the own loss: :func:`prp_surrogate_loss` aggregates over peer sequences only
(``loss_type`` as docs/grpo.md) and multiplies by ``lambda_prp``. GRPO over the pooled group is
recovered by weighting the own and peer losses by their share of sequences (``grpo``) or
tokens (``bnpo``/``dapo``); or concatenate :func:`prp_token_losses` with the own token losses
and aggregate once.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mrl_lightning.metrics import ESS, Max, Mean, Sum
from mrl_lightning.objectives.grpo import aggregate_loss, group_advantages
from mrl_lightning.objectives.loss_types import build_loss_type, importance_weights

IS_MODES = ("truncate", "clip", "none")
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")



def _check_weights_args(
    logp_receiver: Tensor, logp_source_mapped: Tensor, mask: Tensor, is_mode: str, is_level: str, c: float
) -> list[str]:
    problems = []
    if logp_receiver.dim() != 2 or logp_receiver.shape != logp_source_mapped.shape or logp_receiver.shape != mask.shape:
        problems.append(
            "logp_receiver, logp_source_mapped and mask must share one [M, L] shape, got "
            f"{tuple(logp_receiver.shape)}, {tuple(logp_source_mapped.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        problems.append(f"mask must be bool (True = counted token), got {mask.dtype}")
    if is_mode not in IS_MODES:
        problems.append(f"is_mode={is_mode!r} is not valid; valid: {list(IS_MODES)}")
    if is_level not in IS_LEVELS:
        problems.append(f"is_level={is_level!r} is not valid; valid: {list(IS_LEVELS)}")
    if not (isinstance(c, (int, float)) and c > 0) or (is_mode == "clip" and c < 1):
        problems.append(f"c={c!r} must be > 0 (and >= 1 for is_mode='clip', which clamps to [1/c, c])")
    return problems


def prp_log_ratio(logp_receiver: Tensor, logp_source_mapped: Tensor, mask: Tensor, is_level: str) -> Tensor:
    """log rho = logp_recv - logp_src, nats, detached; 0 where ``mask`` is False.

    Returns:
        ``[M, L]`` at ``is_level="token"``, ``[M]`` (sum over counted tokens) at ``"sequence"``.
    """
    lr = torch.where(mask, (logp_receiver - logp_source_mapped).detach(), torch.zeros_like(logp_receiver))
    return lr.sum(dim=1) if is_level == "sequence" else lr


def _log_weight(log_ratio: Tensor, is_mode: str, c: float) -> Tensor:
    log_c = math.log(c)
    if is_mode == "truncate":
        return log_ratio.clamp(max=log_c)
    if is_mode == "clip":
        return log_ratio.clamp(min=-log_c, max=log_c)
    return torch.zeros_like(log_ratio)


def prp_importance_weights(
    logp_receiver: Tensor,
    logp_source_mapped: Tensor,
    mask: Tensor,
    is_mode: str = "truncate",
    is_level: str = "token",
    c: float = 1.0,
) -> Tensor:
    """Importance weights of peer samples, w = f(pi_i / pi_j) (docs/probes.md).

    Computed in log space (clamping the log-ratio), so long sequences do not overflow.

    Args:
        logp_receiver: ``[M, L]`` float, nats: i's log-probs of the peer tokens.
        logp_source_mapped: ``[M, L]`` float, nats: j's sampling log-probs mapped onto i's
            tokens by THL.
        mask: ``[M, L]`` bool, True = counted completion token.
        is_mode: ``"truncate"`` min(rho, c), ``"clip"`` clamp(rho, 1/c, c), ``"none"`` 1.
        is_level: ``"token"`` (one weight per token) or ``"sequence"`` (rho = product over
            the sequence's counted tokens).
        c: Cap, > 0 (>= 1 for ``clip``).

    Returns:
        Detached weights: ``[M, L]`` at token level (0 where ``mask`` is False) or ``[M]``
        at sequence level.

    Raises:
        ValueError: shape/dtype mismatch or an invalid ``is_mode``, ``is_level`` or ``c``
            (all problems at once).
    """
    problems = _check_weights_args(logp_receiver, logp_source_mapped, mask, is_mode, is_level, c)
    if problems:
        raise ValueError("prp_importance_weights: " + "; ".join(problems))
    w = _log_weight(prp_log_ratio(logp_receiver, logp_source_mapped, mask, is_level), is_mode, c).exp()
    return w if is_level == "sequence" else torch.where(mask, w, torch.zeros_like(w))


def prp_pooled_advantages(
    own_rewards: Tensor,
    peer_rewards: Tensor,
    peer_mask: Tensor | None = None,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """GRPO advantages over the pooled group own G + present peers (docs/probes.md, formulas docs/grpo.md).

    A prompt with at least one present peer: mean and Bessel-corrected std (as TRL) over its
    own and present peer rewards; ``"batch"`` takes the std over every counted reward of the
    pooled batch (own rewards of every row and every present peer reward). A pooled group
    whose rewards are all equal gets exactly 0 (as plain GRPO, not the float rounding of
    its mean divided by ``std + eps``).

    A prompt with no present peer gets plain GRPO advantages,
    :func:`~mrl_lightning.objectives.grpo.group_advantages` of ``own_rewards`` with the
    same ``scale_rewards`` and ``eps``, bit for bit (for ``"batch"`` that is the std of the
    own rewards alone, as the trainer's GRPO).

    Args:
        own_rewards: ``[B, G]`` float rewards of the receiver's completions.
        peer_rewards: ``[B, M]`` float rewards of the pooled peer completions.
        peer_mask: ``[B, M]`` bool, True = the peer slot is filled; ``None`` = all filled.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        eps: Added to the std (TRL's 1e-4).

    Returns:
        ``(own_adv [B, G], peer_adv [B, M])`` in ``own_rewards.dtype``; ``peer_adv`` is 0
        where ``peer_mask`` is False.

    Raises:
        ValueError: shapes, non-bool mask, NaN/inf among counted rewards, unknown
            ``scale_rewards``, ``eps <= 0``, or a pooled group of fewer than 2 rewards.
    """
    mask = torch.ones_like(peer_rewards, dtype=torch.bool) if peer_mask is None else peer_mask
    problems = []
    if own_rewards.dim() != 2 or peer_rewards.dim() != 2 or own_rewards.shape[0] != peer_rewards.shape[0]:
        problems.append(
            f"own_rewards must be [B, G] and peer_rewards [B, M], got {tuple(own_rewards.shape)} "
            f"and {tuple(peer_rewards.shape)}"
        )
    elif mask.shape != peer_rewards.shape or mask.dtype != torch.bool:
        problems.append(f"peer_mask must be bool {tuple(peer_rewards.shape)}, got {mask.dtype} {tuple(mask.shape)}")
    elif not (torch.isfinite(own_rewards).all() and torch.isfinite(peer_rewards[mask]).all()):
        problems.append("rewards hold NaN/inf; drop or mask unscored completions")
    elif (own_rewards.shape[1] + mask.sum(1) < 2).any():
        problems.append("every pooled group needs at least 2 rewards (G + present peers)")
    if scale_rewards not in SCALE_REWARDS:
        problems.append(f"scale_rewards={scale_rewards!r} is not valid; valid: {list(SCALE_REWARDS)}")
    if not eps > 0:
        problems.append(f"eps={eps!r} must be > 0")
    if problems:
        raise ValueError("prp_pooled_advantages: " + "; ".join(problems))

    rewards = torch.cat([own_rewards, torch.where(mask, peer_rewards, torch.zeros_like(peer_rewards))], 1)
    counted = torch.cat([torch.ones_like(own_rewards, dtype=torch.bool), mask], 1)
    cw = counted.to(rewards.dtype)
    n = cw.sum(1, keepdim=True)
    mean = (rewards * cw).sum(1, keepdim=True) / n
    big = torch.finfo(rewards.dtype).max
    hi = torch.where(counted, rewards, torch.full_like(rewards, -big)).max(1, keepdim=True).values
    lo = torch.where(counted, rewards, torch.full_like(rewards, big)).min(1, keepdim=True).values
    centered = torch.where(counted & (hi != lo), rewards - mean, torch.zeros_like(rewards))
    if scale_rewards == "group":
        std = ((centered * centered).sum(1, keepdim=True) / (n - 1)).sqrt()
        adv = centered / (std + eps)
    elif scale_rewards == "batch":
        std = rewards[counted].std()  # over every counted reward of the pooled batch, as TRL
        adv = centered / (std + eps)
    else:
        adv = centered
    adv = torch.where(counted, adv, torch.zeros_like(adv))
    g = own_rewards.shape[1]
    has_peer = mask.any(1, keepdim=True)
    own_adv = torch.where(has_peer, adv[:, :g], group_advantages(own_rewards, scale_rewards, eps))
    return own_adv, adv[:, g:]


def prp_token_losses(
    logp_theta: Tensor,
    logp_receiver: Tensor,
    logp_source_mapped: Tensor,
    mask: Tensor,
    peer_advantages: Tensor,
    is_mode: str = "truncate",
    is_level: str = "token",
    c: float = 1.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    *,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    **loss_options: float | None,
) -> Tensor:
    """Per-token PRP peer loss l_t (module docstring), 0 where ``mask`` is False.

    Args:
        logp_theta: ``[M, L]`` float, nats, with gradient: i's current log-probs.
        logp_receiver: ``[M, L]`` nats: i's log-probs when the batch was composed (no grad).
        logp_source_mapped: ``[M, L]`` nats: j's sampling log-probs on i's tokens (THL).
        mask: ``[M, L]`` bool, True = counted token.
        peer_advantages: ``[M]`` (or ``[M, 1]``) advantages of the peer sequences.
        is_mode, is_level, c: As :func:`prp_importance_weights`.
        epsilon_low, epsilon_high: PPO clip range (``epsilon_high=None`` -> ``epsilon_low``),
            as TRL's ``epsilon`` / ``epsilon_high`` (CISPO's cap is ``epsilon_high``).
        loss_type: The receiver's ``loss_type`` whose per-token term is used (docs/grpo.md); the
            four clipped types ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo`` share one term.
        importance_sampling_level: The receiver's level for the ratio r (``sequence``: GSPO's
            exp of the mean log-ratio over the sequence's counted tokens, ``[M, 1]``).
        **loss_options: The loss type's own options (``delta``, ``sapo_temperature_*``,
            ``vespo_*``; TRL names), as :func:`~mrl_lightning.objectives.loss_types.build_loss_type`.

    Returns:
        ``[M, L]`` token losses (gradient flows only through ``logp_theta``).

    Raises:
        ValueError: as :func:`prp_importance_weights`, or ``peer_advantages`` not ``[M]``,
            a negative epsilon, or an unknown loss type, level or option.
    """
    w = prp_importance_weights(logp_receiver, logp_source_mapped, mask, is_mode, is_level, c)
    adv = peer_advantages.reshape(-1)
    problems = []
    if adv.shape[0] != logp_theta.shape[0] or logp_theta.shape != mask.shape:
        problems.append(
            f"logp_theta must be [M, L]={tuple(mask.shape)} and peer_advantages [M], got "
            f"{tuple(logp_theta.shape)} and {tuple(peer_advantages.shape)}"
        )
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if epsilon_low < 0 or eps_high < 0:
        problems.append(f"epsilon_low={epsilon_low!r}, epsilon_high={epsilon_high!r} must be >= 0")
    if problems:
        raise ValueError("prp_token_losses: " + "; ".join(problems))
    if is_level == "sequence":
        w = w[:, None]
    kind = build_loss_type(loss_type, epsilon=epsilon_low, epsilon_high=eps_high, **loss_options)
    log_ratio = logp_theta - logp_receiver.detach()
    ratio = importance_weights(log_ratio, mask, importance_sampling_level)
    per_token, _ = kind.per_token(ratio, log_ratio, logp_theta, adv.detach()[:, None], mask)
    per_token = per_token.expand(mask.shape)
    return torch.where(mask, w * per_token, torch.zeros_like(per_token))


def aggregate_token_losses(
    token_losses: Tensor, mask: Tensor, loss_type: str = "grpo", max_completion_length: int | None = None
) -> Tensor:
    """Reduce ``[M, L]`` token losses to a scalar as docs/grpo.md ``loss_type`` (TRL's names).

    Thin wrapper over :func:`mrl_lightning.objectives.grpo.aggregate_loss` with this batch's
    own normalizers.

    ``grpo`` / ``sapo``: mean over each sequence's counted tokens, then over sequences
    (sequences with no counted token contribute 0); ``bnpo`` / ``dapo`` / ``cispo`` / ``vespo``:
    sum / counted tokens; ``dr_grpo``: sum / (M * max_completion_length, default L); ``luspo``:
    each sequence's sum, then the mean over sequences.

    Raises:
        ValueError: unknown ``loss_type``.
    """
    return aggregate_loss(token_losses, mask, loss_type, max_completion_length)


def prp_surrogate_loss(
    logp_theta: Tensor,
    logp_receiver: Tensor,
    logp_source_mapped: Tensor,
    mask: Tensor,
    peer_advantages: Tensor,
    is_mode: str = "truncate",
    is_level: str = "token",
    c: float = 1.0,
    lambda_prp: float = 1.0,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    importance_sampling_level: str = "token",
    **loss_options: float | None,
) -> Tensor:
    """lambda_prp times the aggregated peer loss (docs/probes.md); 0 (with grad) when M = 0.

    Arguments as :func:`prp_token_losses` and :func:`aggregate_token_losses`; ``loss_type``
    chooses both the per-token term and the aggregation.

    Raises:
        ValueError: as those two, or ``lambda_prp < 0``.
    """
    if not lambda_prp >= 0:
        raise ValueError(f"prp_surrogate_loss: lambda_prp={lambda_prp!r} must be >= 0")
    if logp_theta.shape[0] == 0:
        return logp_theta.sum() * 0.0
    losses = prp_token_losses(
        logp_theta, logp_receiver, logp_source_mapped, mask, peer_advantages,
        is_mode, is_level, c, epsilon_low, epsilon_high,
        loss_type=loss_type, importance_sampling_level=importance_sampling_level, **loss_options,
    )
    return lambda_prp * aggregate_token_losses(losses, mask, loss_type, max_completion_length)


def prp_weight_metrics(
    logp_receiver: Tensor,
    logp_source_mapped: Tensor,
    mask: Tensor,
    is_mode: str = "truncate",
    is_level: str = "token",
    c: float = 1.0,
) -> dict[str, float]:
    """What the importance weights did, under ``probe/`` (docs/probes.md, PRP "Logged").

    Units are counted tokens (``is_level="token"``) or sequences (``"sequence"``).
    ESS = (sum w)^2 / sum w^2, reported divided by the number of units (1 = all equal).

    Returns:
        ``probe/prp_units``, ``probe/prp_ess`` (applied weights), ``probe/prp_ess_raw``
        (uncapped rho), ``probe/prp_log_ratio_mean``, ``probe/prp_log_ratio_max``,
        ``probe/prp_log_ratio_abs_max`` (nats), ``probe/prp_weight_mean``,
        ``probe/prp_frac_capped`` (share of units whose weight the mode changed). All 0
        when there are no units.

    Raises:
        ValueError: as :func:`prp_importance_weights`.
    """
    problems = _check_weights_args(logp_receiver, logp_source_mapped, mask, is_mode, is_level, c)
    if problems:
        raise ValueError("prp_weight_metrics: " + "; ".join(problems))
    lr = prp_log_ratio(logp_receiver, logp_source_mapped, mask, is_level).double()
    if is_level == "token":
        lr = lr[mask]
    keys = ("units", "ess", "ess_raw", "log_ratio_mean", "log_ratio_max", "log_ratio_abs_max", "weight_mean", "frac_capped")
    if lr.numel() == 0:
        return {f"probe/prp_{k}": Sum(0.0) if k == "units" else Mean(0.0, 0.0) for k in keys}
    log_w = _log_weight(lr, is_mode, c)
    capped = (log_w != lr) if is_mode != "none" else torch.zeros_like(lr, dtype=torch.bool)

    def ess(log_weights: Tensor) -> float:
        w = (log_weights - log_weights.max()).exp()  # scale-free, so shift for stability
        return float(w.sum() ** 2 / (w * w).sum()) / log_weights.numel()

    n = float(lr.numel())  # each value says how it pools over ranks (mrl_lightning.metrics)
    values = (
        Sum(n), ESS.of(log_w, ess(log_w)), ESS.of(lr, ess(lr)), Mean(float(lr.mean()), n), Max(float(lr.max())),
        Max(float(lr.abs().max())), Mean(float(log_w.exp().mean()), n), Mean(float(capped.double().mean()), n),
    )
    return {f"probe/prp_{k}": v for k, v in zip(keys, values)}
