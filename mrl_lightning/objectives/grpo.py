"""GRPO objective as pure functions on tensors (``docs/grpo.md``).

Shapes: B prompts, G completions per prompt, N = B*G sequences, L completion length.
Log-probs are float32 nats. ``completion_mask`` is True where a token is counted.

Option names and numbers follow TRL's ``GRPOConfig`` (trl 1.16) where the meaning is
the same: ``scale_rewards`` ("group" | "batch" | "none"), ``epsilon`` / ``epsilon_high``,
``beta`` with the k3 KL estimator, ``use_bias_correction_kl``, ``loss_type`` (the eight
of :mod:`mrl_lightning.objectives.loss_types`), ``importance_sampling_level``,
``max_completion_length``. Departures from TRL, stated once here:

- The std for ``scale_rewards`` uses Bessel's correction and eps = 1e-4, as TRL does.
- A NaN reward (a verifier that could not score) is excluded from its group's
  statistics and gets advantage 0, so it neither poisons the batch nor moves the policy;
  TRL instead ``nansum``s over reward functions. Per-function NaNs are combined with
  nansum (as TRL) in :func:`combine_rewards`; only an all-NaN row stays NaN.
- A group whose rewards are all equal gets advantage exactly 0; TRL divides the float32
  rounding error of its mean by ``std + eps`` (advantages of order 1e-4 for eight
  rewards of 0.1, 0.3 or 0.7).
- The k3 KL bounds its log-ratio to ``kl_log_ratio_clamp`` nats (default 20, verl's
  ``low_var_kl`` clamp); TRL has no bound and returns ``inf`` once the log-ratio passes
  ~88 nats. Set ``kl_log_ratio_clamp: null`` for TRL's numbers.
- ``dapo`` normalizes by the number of counted tokens in the whole step batch, which on
  one process equals ``bnpo``; both take an explicit ``num_tokens`` so micro-batches of
  one step share the normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mrl_lightning.objectives.loss_types import LOSS_TYPES, build_loss_type, importance_weights
from mrl_lightning.objectives.masks import off_policy_sequence_mask

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPE_NAMES = tuple(LOSS_TYPES)  # TRL 1.16's order: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo
# Bound in nats on |log pi_ref - log pi_theta| inside the k3 KL (verl's low_var_kl uses 20).
KL_LOG_RATIO_CLAMP = 20.0


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


def center_groups(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group mean, centered rewards and Bessel std, as :func:`group_advantages` uses them.

    NaN rewards are left out of mean and std and get a centered value of 0. A group whose
    valid rewards are all equal gets centered values and std of exactly 0 (a float32 mean
    of e.g. eight 0.1s is not exactly 0.1, and dividing that rounding error by ``std +
    eps`` would give advantages of order 1e-4). Other modules that must agree with plain
    GRPO to the last bit (XGRPO with ``alpha = 0``) build on this function.

    Args:
        rewards: ``[B, G]`` float32 rewards (NaN allowed).

    Returns:
        ``(mean, centered, std)``: ``[B, 1]``, ``[B, G]``, ``[B, 1]``, in ``rewards.dtype``
        (reward units). ``std`` uses Bessel's correction, as TRL does.

    Raises:
        ValueError: ``rewards`` not 2-D.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G]; got shape {tuple(rewards.shape)}")
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    mean = r.sum(dim=1, keepdim=True) / count
    centered = torch.where(valid, r - mean, torch.zeros_like(r))
    big = torch.finfo(r.dtype).max
    hi = torch.where(valid, r, torch.full_like(r, -big)).max(dim=1, keepdim=True).values
    lo = torch.where(valid, r, torch.full_like(r, big)).min(dim=1, keepdim=True).values
    centered = torch.where(hi == lo, torch.zeros_like(centered), centered)
    var = centered.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    return mean, centered, var.sqrt()


def group_advantages(rewards: Tensor, scale_rewards: str = "group", eps: float = 1e-4,
                     batch_std: Tensor | None = None) -> Tensor:
    """Group-relative advantages (``docs/grpo.md``; TRL ``scale_rewards``).

    ``A_k = (r_k - mean(r)) / (std + eps)``, std over the group ("group"), over the whole
    batch ("batch"), or no scaling ("none"). NaN rewards are left out of mean and std and
    get advantage 0. A group with identical rewards gets exactly 0 (no NaN).

    Args:
        rewards: ``[B, G]`` float32 rewards (NaN allowed).
        scale_rewards: "group", "batch" or "none".
        eps: Added to the std (TRL uses 1e-4).
        batch_std: ``[]`` the "batch" std when the batch is larger than ``rewards`` (a
            policy's prompts split over data-parallel ranks: the std of the whole batch);
            None = the std of ``rewards``.

    Returns:
        ``[B, G]`` float32 advantages, finite everywhere.

    Raises:
        ValueError: unknown ``scale_rewards`` or ``rewards`` not 2-D.
    """
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    _, centered, std = center_groups(rewards)
    valid = ~torch.isnan(rewards)
    if scale_rewards == "group":
        adv = centered / (std + eps)
    elif scale_rewards == "batch" and batch_std is not None:
        adv = centered / (batch_std + eps)
    elif scale_rewards == "batch":
        r = torch.where(valid, rewards, torch.zeros_like(rewards))
        n = valid.sum().clamp(min=1)
        bmean = r.sum() / n
        bvar = torch.where(valid, (r - bmean).pow(2), torch.zeros_like(r)).sum() / (n - 1).clamp(min=1)
        adv = centered / (bvar.sqrt() + eps)
    else:
        adv = centered
    return torch.where(valid, adv, torch.zeros_like(adv))


def k3_kl(logp: Tensor, ref_logp: Tensor, log_ratio_clamp: float | None = KL_LOG_RATIO_CLAMP) -> Tensor:
    """Per-token k3 KL estimator with a bounded log-ratio (``docs/grpo.md``; TRL ``beta``).

    ``d = clamp(ref - logp, -c, c)``, ``KL_t = exp(d) - d - 1`` (>= 0), Schulman's k3 as in
    TRL's GRPO. The bound ``c`` on the log-ratio is verl's ``low_var_kl`` clamp (verl uses
    20 nats): without it a token the policy gives -120 nats and the reference -0.01
    overflows float32 (``exp(119.99) = inf``). A token whose log-ratio is past the bound
    gets the bound's value and no gradient.

    Args:
        logp: ``[N, L]`` float32 nats, current policy.
        ref_logp: ``[N, L]`` float32 nats, reference model.
        log_ratio_clamp: ``c`` in nats, > 0; None = no bound (plain k3, TRL's numbers).

    Returns:
        ``[N, L]`` float32 nats; at most ``exp(c) - c - 1`` (4.85e8 for c = 20).

    Raises:
        ValueError: ``log_ratio_clamp`` is not None and not > 0.
    """
    delta = ref_logp - logp
    if log_ratio_clamp is not None:
        _check_log_ratio_clamp(log_ratio_clamp)
        delta = torch.clamp(delta, -log_ratio_clamp, log_ratio_clamp)
    return torch.exp(delta) - delta - 1.0


def _check_log_ratio_clamp(value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(
            f"kl_log_ratio_clamp={value!r} must be > 0 (a bound in nats on |log pi_ref - log pi_theta|, "
            f"verl uses {KL_LOG_RATIO_CLAMP}) or None to turn the bound off."
        )


@dataclass
class PolicyLossOutput:
    """Result of :func:`grpo_loss`.

    Attributes:
        loss: scalar, the aggregated loss (already divided by the step's normalizer).
        per_token_loss: ``[N, L]`` float32 before aggregation.
        ratio: ``[N, L]`` importance weight at the chosen level, ``exp(logp - old_logp)`` per
            token or its sequence value repeated over the row.
        kl: ``[N, L]`` float32 nats, the KL term added to the loss before ``beta``: k3 with
            the log-ratio bound, times the ratio when ``use_bias_correction_kl`` (what TRL
            logs as ``kl``); None when beta == 0.
        clipped_low / clipped_high: ``[N, L]`` bool, counted tokens where the clip was active
            (all False for a loss type without a clip).
        kl_clamped: ``[N, L]`` bool, True where the KL log-ratio hit ``kl_log_ratio_clamp``;
            None when beta == 0.
        stats: The loss type's statistics by TRL's tag name (``clip_ratio_low``,
            ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ...), each ``[N, L]`` (a share over
            counted tokens) or ``[N, 1]`` (a mean over sequences), detached.
        off_policy_mask: ``[N, 1]`` float32, 1 = kept, with ``off_policy_mask_threshold``; else None.
    """

    loss: Tensor
    per_token_loss: Tensor
    ratio: Tensor
    kl: Tensor | None
    clipped_low: Tensor
    clipped_high: Tensor
    kl_clamped: Tensor | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    off_policy_mask: Tensor | None = None


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
    use_bias_correction_kl: bool = True,
    kl_log_ratio_clamp: float | None = KL_LOG_RATIO_CLAMP,
    sampler_weights: Tensor | None = None,
    importance_sampling_level: str = "token",
    entropy_mask: Tensor | None = None,
    off_policy_mask_threshold: float | None = None,
    sampling_logp: Tensor | None = None,
    **loss_options: float | None,
) -> PolicyLossOutput:
    """One ``loss_type``'s policy term with optional k3 KL, aggregated (``docs/grpo.md``; TRL ``_compute_loss``).

    With ``w`` the importance weight (:func:`~mrl_lightning.objectives.loss_types.importance_weights`:
    per token, or per sequence for GSPO), the per-token loss is

        ``l_t = policy_t(w, A) * M_t * s_t + beta KL_t``

    where ``policy_t`` is the loss type's term (:mod:`mrl_lightning.objectives.loss_types`; for
    ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo`` / ``luspo`` the clipped surrogate
    ``-min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)``), ``M_t`` the masks on the policy
    term (``off_policy_mask_threshold``, ``entropy_mask``; :mod:`mrl_lightning.objectives.masks`),
    ``s_t`` the sampler-correction weights, and ``KL_t = v_t * k3(clamp(ref - logp, -c, c))``
    with ``v_t = w_t`` (not detached, as TRL's ``use_bias_correction_kl``) or 1. On a token whose
    log-ratio is past the bound ``c`` the KL term is a constant (``w`` detached there): it adds
    its bounded value and no gradient, since the ratio's gradient alone would push that token's
    log-prob further down. Aggregation over counted tokens (mask m), by the loss type:

    - ``grpo``, ``sapo``: mean over each sequence's tokens, then sum / ``num_sequences``
    - ``bnpo``, ``dapo``, ``cispo``, ``vespo``: sum over tokens / ``num_tokens``
    - ``dr_grpo``: sum over tokens / (``num_sequences`` * ``max_completion_length``)
    - ``luspo``: sum over each sequence's tokens, then sum / ``num_sequences``

    ``num_sequences`` and ``num_tokens`` default to this batch's own counts; pass the
    whole step's counts when the step is split into micro-batches so that the sum of
    micro-batch losses equals the full-batch loss.

    Args:
        logp: ``[N, L]`` float32 nats under the current policy (requires grad).
        old_logp: ``[N, L]`` float32 nats under the sampling policy.
        advantages: ``[N]`` or ``[N, L]`` float32.
        completion_mask: ``[N, L]`` bool, True = counted.
        loss_type: A name of :data:`~mrl_lightning.objectives.loss_types.LOSS_TYPES` (TRL ``loss_type``).
        epsilon: Lower clip (TRL ``epsilon``).
        epsilon_high: Upper clip, and CISPO's cap; defaults to ``epsilon`` (TRL ``epsilon_high``).
        beta: KL weight; 0 disables the KL term (TRL ``beta``).
        ref_logp: ``[N, L]`` float32 nats, reference log-probs; required when ``beta > 0``.
        max_completion_length: Required for ``dr_grpo``.
        num_sequences: Normalizer for grpo / dr_grpo / sapo / luspo.
        num_tokens: Normalizer for bnpo / dapo / cispo / vespo.
        use_bias_correction_kl: Multiply the per-token k3 by ``w`` (TRL 1.16's
            ``use_bias_correction_kl``, default True there too). On-policy at token level its
            gradient is then ``beta * (logp - ref)`` per token, linear in the log-ratio.
        kl_log_ratio_clamp: Bound ``c`` in nats on ``|ref - logp|`` inside k3 (verl's
            ``low_var_kl`` clamp, 20 there and here); None = unbounded, TRL's numbers.
        sampler_weights: ``[N, L]`` or ``[N, 1]`` float32, detached: importance weights of
            the trainer over a different sampler (vLLM), multiplying the policy term of each
            token but not the KL term, or folded into VESPO's weight (TRL
            ``vllm_importance_sampling_correction``; :mod:`mrl_lightning.rollout.sampler_correction`). None = 1.
        importance_sampling_level: ``token`` or ``sequence`` (GSPO; TRL ``importance_sampling_level``).
        entropy_mask: ``[N, L]`` bool, tokens whose policy term counts (TRL ``top_entropy_quantile``,
            :func:`~mrl_lightning.objectives.masks.high_entropy_mask`); None = every token.
        off_policy_mask_threshold: delta of the off-policy sequence mask (TRL's name); None = off.
        sampling_logp: ``[N, L]`` float32 nats, the sampler's log-probs the off-policy mask
            compares with; None = ``old_logp``.
        **loss_options: The loss types' own options (TRL names: ``delta``, ``sapo_temperature_pos``
            / ``_neg``, ``vespo_k_pos`` / ``_neg``, ``vespo_lambda_pos`` / ``_neg``); each type
            reads its own and ignores the others, as TRL does.

    Returns:
        :class:`PolicyLossOutput`.

    Raises:
        ValueError: unknown ``loss_type``, level or option; ``beta > 0`` without ``ref_logp``;
            ``dr_grpo`` without ``max_completion_length``; shape mismatch;
            ``kl_log_ratio_clamp`` not > 0.
    """
    kind = build_loss_type(loss_type, epsilon=epsilon, epsilon_high=epsilon_high, **loss_options)
    _check_log_ratio_clamp(kl_log_ratio_clamp)
    if logp.shape != old_logp.shape or logp.shape != completion_mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and completion_mask "
            f"{tuple(completion_mask.shape)} must all be [N, L]."
        )
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs); set beta: 0.0 to disable KL.")
    if kind.aggregation == "fixed_length" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length.")
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages

    log_ratio = logp - old_logp
    ratio = importance_weights(log_ratio, completion_mask, importance_sampling_level)
    folded = sampler_weights.detach().to(logp.dtype) if sampler_weights is not None else None
    per_token, stats = kind.per_token(ratio, log_ratio, logp, adv, completion_mask,
                                      folded if kind.folds_sampler_weights else None)
    keep = None
    if off_policy_mask_threshold is not None:
        keep = off_policy_sequence_mask(adv, logp, old_logp if sampling_logp is None else sampling_logp,
                                        completion_mask, off_policy_mask_threshold)
        per_token = per_token * keep
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if folded is not None and not kind.folds_sampler_weights:
        per_token = per_token * folded
    per_token = per_token.expand(completion_mask.shape)
    kl = kl_clamped = None
    if beta > 0:
        kl = k3_kl(logp, ref_logp, kl_log_ratio_clamp)
        if kl_log_ratio_clamp is None:
            kl_clamped = torch.zeros_like(completion_mask)
        else:
            kl_clamped = (ref_logp - logp).detach().abs() > kl_log_ratio_clamp
        if use_bias_correction_kl:
            kl = kl * torch.where(kl_clamped, ratio.detach(), ratio)
        per_token = per_token + beta * kl

    loss = aggregate_loss(per_token, completion_mask, loss_type, max_completion_length, num_sequences, num_tokens)

    stats = {k: v.detach() for k, v in stats.items()}
    none = torch.zeros_like(completion_mask)
    low, high = (stats.get(k, none) & completion_mask for k in ("clip_ratio_low", "clip_ratio_high"))
    return PolicyLossOutput(loss, per_token, ratio.expand(completion_mask.shape), kl, low, high,
                            None if kl_clamped is None else kl_clamped & completion_mask, stats, keep)


def _sequence_mean(per_token: Tensor, mask: Tensor, n_seq: int, n_tok, length: int) -> Tensor:
    seq_len = mask.sum(dim=1).clamp(min=1.0)
    return ((per_token * mask).sum(dim=1) / seq_len).sum() / max(n_seq, 1)


def _token_mean(per_token: Tensor, mask: Tensor, n_seq: int, n_tok, length: int) -> Tensor:
    n_tok = mask.sum() if n_tok is None else torch.as_tensor(n_tok, dtype=per_token.dtype)
    return (per_token * mask).sum() / torch.clamp(n_tok, min=1.0)


def _fixed_length(per_token: Tensor, mask: Tensor, n_seq: int, n_tok, length: int) -> Tensor:
    return (per_token * mask).sum() / (max(n_seq, 1) * length)


def _sequence_sum(per_token: Tensor, mask: Tensor, n_seq: int, n_tok, length: int) -> Tensor:
    return (per_token * mask).sum(dim=1).sum() / max(n_seq, 1)


# How each loss type's per-token losses become a scalar (LossType.aggregation names a key).
AGGREGATIONS = {"sequence_mean": _sequence_mean, "token_mean": _token_mean, "fixed_length": _fixed_length,
                "sequence_sum": _sequence_sum}


def aggregate_loss(
    per_token: Tensor,
    completion_mask: Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """Reduce ``[N, L]`` per-token losses to a scalar as ``loss_type`` aggregates (``docs/grpo.md``; TRL names).

    ``grpo`` / ``sapo``: per-sequence mean over counted tokens, summed, / ``num_sequences``;
    ``bnpo`` / ``dapo`` / ``cispo`` / ``vespo``: sum / ``num_tokens``; ``dr_grpo``: sum /
    (``num_sequences`` * ``max_completion_length``, default L); ``luspo``: per-sequence sum,
    summed, / ``num_sequences``. Normalizers default to this batch's own counts.

    Args:
        per_token: ``[N, L]`` float32.
        completion_mask: ``[N, L]`` bool, True = counted.
        loss_type: A name of :data:`~mrl_lightning.objectives.loss_types.LOSS_TYPES`.
        max_completion_length: dr_grpo's length normalizer.
        num_sequences: Sequence normalizer (grpo, dr_grpo, sapo, luspo).
        num_tokens: Token normalizer (bnpo, dapo, cispo, vespo).

    Raises:
        ValueError: unknown ``loss_type``.
    """
    _check_choice("loss_type", loss_type, LOSS_TYPE_NAMES)
    mask = completion_mask.to(per_token.dtype)
    n_seq = per_token.shape[0] if num_sequences is None else num_sequences
    length = per_token.shape[1] if max_completion_length is None else max_completion_length
    return AGGREGATIONS[LOSS_TYPES[loss_type].aggregation](per_token, mask, n_seq, num_tokens, length)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is True; 0 when nothing is counted.

    Args:
        values: ``[N, L]`` float.
        mask: ``[N, L]`` bool, True = counted.
    """
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)
