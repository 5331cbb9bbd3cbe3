"""SGT, Success-Gated Transfer, as pure functions (docs/probes.md).

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


def eligible_rows(own_success: Tensor, prompt_ids: Sequence[str], peer_successes: dict[str, list[str]],
                  kappa: float = 0.0) -> list[bool]:
    """Per row, whether its prompt may be rescued: own success rate <= kappa and a peer success exists.

    Args:
        own_success: ``[B, G]`` bool, the receiver's own successes.
        prompt_ids: B prompt ids, row order of ``own_success``.
        peer_successes: prompt id -> verified peer success texts.
        kappa: A prompt is eligible when its own success rate <= kappa.

    Raises:
        ValueError: shape mismatch or kappa outside [0, 1].
    """
    if own_success.dim() != 2 or own_success.shape[0] != len(prompt_ids):
        raise ValueError(f"own_success must be [B, G] with B = len(prompt_ids) = {len(prompt_ids)}; "
                         f"got {tuple(own_success.shape)}.")
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa={kappa} must be in [0, 1].")
    rate = own_success.float().mean(dim=1)
    return [bool(rate[b] <= kappa) and bool(peer_successes.get(pid)) for b, pid in enumerate(prompt_ids)]


def first_eligible_draws(parts: Sequence[Sequence[tuple[str, bool]]]) -> list[set[int]]:
    """The rows of each rank of a group that hold the first eligible draw of their prompt in the step.

    A prompt drawn twice in one step is rescued once per group, on the draw one rank holding
    the whole batch would rescue: the eligible one at the lowest batch position. The group's
    ranks hold the batch in strided shards (:func:`mrl_lightning.mwra.shard_indices`: row j of
    the rank at group index r is position r + j * k of a group of k ranks).

    Args:
        parts: Per rank, in group order, its rows' ``(prompt id, eligible)``, row order
            (:func:`eligible_rows`).

    Returns:
        Per rank, the set of its row indices that may be rescued.
    """
    from mrl_lightning.mwra.placement import shard_indices

    size, total = len(parts), sum(len(part) for part in parts)
    first: dict[str, int] = {}
    placed: list[list[int]] = []
    for r, part in enumerate(parts):
        positions = shard_indices(total, r, size)
        placed.append(positions)
        for (pid, ok), pos in zip(part, positions):
            if ok and pos < first.get(pid, total):
                first[pid] = pos
    return [{j for j, ((pid, ok), pos) in enumerate(zip(part, positions)) if ok and first.get(pid) == pos}
            for part, positions in zip(parts, placed)]


def rescue_set(
    own_success: Tensor,
    prompt_ids: Sequence[str],
    peer_successes: dict[str, list[str]],
    kappa: float = 0.0,
    max_per_prompt: int = 1,
    rows: set[int] | None = None,
) -> dict[int, list[str]]:
    """Which prompts get which peer successes (docs/probes.md).

    Args:
        own_success: ``[B, G]`` bool, the receiver's own successes.
        prompt_ids: B prompt ids, row order of ``own_success``.
        peer_successes: prompt id -> verified peer success texts, preferred first.
        kappa: A prompt is eligible when its own success rate <= kappa.
        max_per_prompt: m, at most this many distinct texts per prompt.
        rows: The rows that may be rescued (:func:`first_eligible_draws`, on a group of several
            ranks); None = every row, a prompt drawn twice being rescued at its first eligible row.

    Returns:
        Row index b -> up to m distinct texts, only for eligible prompts with a peer success.

    Raises:
        ValueError: shape mismatch, kappa outside [0, 1] or max_per_prompt < 1.
    """
    if max_per_prompt < 1:
        raise ValueError(f"max_per_prompt={max_per_prompt} must be >= 1.")
    eligible = eligible_rows(own_success, prompt_ids, peer_successes, kappa)
    out: dict[int, list[str]] = {}
    seen_prompts: set[str] = set()
    for b, pid in enumerate(prompt_ids):
        if not eligible[b] or pid in seen_prompts or (rows is not None and b not in rows):
            continue  # a prompt drawn twice in one step is rescued once
        out[b] = list(dict.fromkeys(peer_successes[pid]))[:max_per_prompt]
        seen_prompts.add(pid)
    return out


def sgt_loss(logp: Tensor, completion_mask: Tensor, lambda_sgt: float, advantage_plus: float = 1.0,
             num_demos: float | None = None) -> Tensor:
    """``lambda * A_plus * mean over demos of the per-demo mean token NLL`` (docs/probes.md).

    Args:
        logp: ``[M, L]`` float32 nats, receiver log-probs of the retokenized demos.
        completion_mask: ``[M, L]`` bool, True = a demo token (EOS included).
        lambda_sgt: Transfer weight lambda.
        advantage_plus: A_plus, the positive advantage given to a verified success.
        num_demos: The mean's denominator; None = M. With data-parallel ranks it is the
            demos of the whole group, so the ranks' losses add up to the one-rank loss.

    Returns:
        Scalar loss (0 when M == 0).
    """
    if logp.numel() == 0:
        return logp.sum() * 0.0
    mask = completion_mask.to(logp.dtype)
    per_demo = -(logp * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return lambda_sgt * advantage_plus * per_demo.sum() / (num_demos if num_demos else per_demo.numel())


def pad_demos(demos: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Tensor, ...]:
    """Left-pad prompts and right-pad completions of ``(prompt_ids, completion_ids)`` pairs.

    Returns:
        ``(prompt_ids [M, P], prompt_mask [M, P], completion_ids [M, L], completion_mask [M, L])``.
    """
    from mrl_lightning.rollout.base import left_pad

    p_ids, p_mask = left_pad([p for p, _ in demos], pad_id)
    width = max(len(c) for _, c in demos)
    c_ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(demos), width), dtype=torch.bool)
    for i, (_, c) in enumerate(demos):
        c_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, : len(c)] = True
    return p_ids, p_mask, c_ids, c_mask


def transfer_group_advantages(own_rewards: Tensor, demo_rewards: Sequence[Sequence[float]],
                              scale_rewards: str = "group", eps: float = 1e-4) -> tuple[Tensor, list[Tensor]]:
    """Advantages when transferred successes join the receiver's group as extra samples.

    ``transfer_mode: group`` (docs/probes.md): for each rescued prompt the receiver's own G
    rewards and its m transferred successes' verified rewards form one group of G + m, and
    GRPO's group advantages (:func:`mrl_lightning.objectives.grpo.group_advantages`, Bessel
    std, eps 1e-4) are computed over it. An all-fail group of 8 with one success of reward 1
    gives the success (1 - 1/9) / (1/3 + eps) = 2.666 and each own failure -0.333.
    ``scale_rewards: batch`` is taken per group here (the transfer changes one group only).

    Args:
        own_rewards: ``[R, G]`` float32, the receiver's rewards on the R rescued prompts (NaN allowed).
        demo_rewards: R lists of the transferred successes' verified rewards (m_r >= 1 each).
        scale_rewards: "group", "batch" (as "group") or "none".
        eps: Added to the std.

    Returns:
        ``(own [R, G] float32, [demo advantages [m_r] float32 per prompt])``.

    Raises:
        ValueError: ``len(demo_rewards) != R``, a prompt without demos, or an unknown ``scale_rewards``.
    """
    from mrl_lightning.objectives.grpo import group_advantages

    if own_rewards.dim() != 2 or own_rewards.shape[0] != len(demo_rewards):
        raise ValueError(f"own_rewards must be [R, G] with R = len(demo_rewards) = {len(demo_rewards)}; "
                         f"got {tuple(own_rewards.shape)}.")
    if any(len(d) == 0 for d in demo_rewards):
        raise ValueError("every rescued prompt needs at least one transferred success (demo_rewards has an empty list).")
    scale = "group" if scale_rewards == "batch" else scale_rewards
    own_out, demo_out = torch.zeros_like(own_rewards), []
    g = own_rewards.shape[1]
    for r, demos in enumerate(demo_rewards):
        row = torch.cat([own_rewards[r], torch.tensor(list(demos), dtype=own_rewards.dtype)]).unsqueeze(0)
        adv = group_advantages(row, scale, eps=eps)[0]
        own_out[r] = adv[:g]
        demo_out.append(adv[g:])
    return own_out, demo_out


def sgt_group_loss(logp: Tensor, completion_mask: Tensor, advantages: Tensor, lambda_sgt: float, loss_type: str,
                   num_sequences: float, num_tokens: float, max_completion_length: int | None = None) -> Tensor:
    """Transferred successes as extra GRPO samples: ``lambda * agg(-A_d * log p)`` (docs/probes.md).

    The surrogate of a sample at ratio 1 (the text was not sampled by the receiver, so there
    is no ratio to clip): per token ``-A_d * log pi_theta(y_t)``, aggregated with the
    receiver's ``loss_type`` and the *batch's* normalizers (own samples plus transfers), so
    with ``lambda_sgt`` 1 a transfer weighs exactly what an own sample of the same
    advantage weighs.

    Args:
        logp: ``[M, L]`` float32 nats, receiver log-probs of the retokenized demos.
        completion_mask: ``[M, L]`` bool, True = a demo token (EOS included).
        advantages: ``[M]`` float32, from :func:`transfer_group_advantages`.
        lambda_sgt: Weight of the transfer samples (1 = an own sample's weight).
        loss_type: The receiver's ``loss_type``.
        num_sequences: Sequences of the batch, transfers included (grpo, dr_grpo).
        num_tokens: Counted tokens of the batch, transfers included (bnpo, dapo).
        max_completion_length: dr_grpo's length normalizer.

    Returns:
        Scalar loss (0 when M == 0).

    Raises:
        ValueError: unknown ``loss_type``.
    """
    from mrl_lightning.objectives.grpo import aggregate_loss

    if logp.numel() == 0:
        return logp.sum() * 0.0
    per_token = -advantages.to(logp.dtype).unsqueeze(1) * logp
    return lambda_sgt * aggregate_loss(per_token, completion_mask, loss_type, max_completion_length,
                                       num_sequences=int(num_sequences), num_tokens=num_tokens)


class ShareBound:
    """The step's bound on the transfer's share of the update (``max_grad_share``), fixed or moving (docs/probes.md).

    - fixed: ``start`` at every step;
    - schedule (``final`` set): linear from ``start`` at step index 0 (the run's first training
      step) to ``final`` at index ``ramp_steps``, ``final`` after;
    - receiver-adaptive (``low`` set): ``start`` while the receiver's strong part holds, down
      to ``low`` as it drops. Its level is the exponential moving average (rate ``ema``) of the
      success rate of its own completions on strong-part prompts; its reference is that
      average's highest value over the first ``reference_steps`` steps (indices 0 to
      ``reference_steps - 1``). With ``ratio`` = level
      / reference: bound = ``start`` at ratio >= 1, ``low`` at ratio <= 1 - ``drop``, linear in
      between. Before any strong-part rollout (or without strong parts) the bound is ``start``.

    Args:
        start: The bound, in (0, 1); None = no bound at all (the other options unused).
        final: Where a schedule ends, in (0, 1); None = no schedule.
        ramp_steps: Rollout steps of the schedule's ramp (>= 1).
        low: The adaptive bound's floor, in (0, 1); None = not adaptive.
        drop: Relative drop of the strong part at which the floor is reached, in (0, 1).
        ema: Moving-average rate of the strong-part level, in (0, 1].
        reference_steps: Steps over which the reference level is taken (>= 1).

    Raises:
        ValueError: an out-of-range value, or both a schedule and an adaptive bound.
    """

    def __init__(self, start: float | None, final: float | None = None, ramp_steps: int = 1000,
                 low: float | None = None, drop: float = 0.1, ema: float = 0.05, reference_steps: int = 50) -> None:
        problems = [f"{name}={value} must be in (0, 1)" for name, value in
                    (("max_grad_share", start), ("final", final), ("low", low), ("drop", drop))
                    if value is not None and not 0.0 < value < 1.0]
        if not 0.0 < ema <= 1.0:
            problems.append(f"ema={ema} must be in (0, 1]")
        if ramp_steps < 1 or reference_steps < 1:
            problems.append(f"ramp_steps={ramp_steps} and reference_steps={reference_steps} must be >= 1")
        if final is not None and low is not None:
            problems.append("a schedule (final) and an adaptive bound (low) cannot both be set")
        if start is None and (final is not None or low is not None):
            problems.append("a schedule or an adaptive bound needs max_grad_share (its start)")
        if problems:
            raise ValueError("; ".join(problems))
        self.start, self.final, self.ramp_steps = start, final, ramp_steps
        self.low, self.drop, self.ema, self.reference_steps = low, drop, ema, reference_steps

    def step_bound(self, step: int, level: float | None = None, reference: float | None = None) -> float | None:
        """The bound at step index ``step``, given the adaptive ``level`` and ``reference`` (None = not known yet).

        Step indices count training steps from 0: the loop's ``rollout_step`` minus 1, since the loop
        counts a step's rollout phase before that step's compose (docs/probes.md, "Moving bounds").
        """
        if self.start is None:
            return None
        if self.final is not None:
            frac = min(1.0, max(step, 0) / self.ramp_steps)
            return self.start + (self.final - self.start) * frac
        if self.low is None or level is None or not reference:
            return self.start
        ratio = level / reference
        frac = min(1.0, max(0.0, (1.0 - ratio) / self.drop))
        return self.start + (self.low - self.start) * frac

    def track(self, state: dict, step: int, successes: float, count: float) -> None:
        """Update a receiver's ``state`` (``level``, ``reference``) with one step's strong-part rollouts.

        Args:
            state: The receiver's ``{"level": float | None, "reference": float | None}``, changed in place.
            step: The step index of these rollouts (0 = the run's first training step).
            successes: Successful completions on strong-part prompts this step (all ranks).
            count: Completions on strong-part prompts this step (all ranks); 0 = nothing to add.
        """
        if self.low is None or count <= 0:
            return
        rate = successes / count
        level = state.get("level")
        state["level"] = rate if level is None else (1 - self.ema) * level + self.ema * rate
        if step < self.reference_steps:
            state["reference"] = max(state.get("reference") or 0.0, state["level"])
