"""CrossPolicyAdvantage callback: XGRPO on top of GRPO (``docs/probes.md``).

Thin adapter over :mod:`mrl_lightning.probes.xgrpo`. The receiver trains on its own
rollouts only (on-policy support kept); only scalars cross: for each of the receiver's
prompts it reads peers' ``GroupStatsRecord`` s from SEE (``ctx.exchange``) and
replaces ``batch.advantages`` with

    b_i(x) = (1 - alpha) * mean(R_i(x)) + alpha * mean(union_j R_j(x))
    s_i(x) = std(union_j R_j(x))   (scale_source="union")  or  std(R_i(x))  ("own")
    A_ik   = (r_ik - b_i(x)) / (s_i(x) + eps)

Choices made here (the method leaves them open):

- Per (prompt, peer) only the newest record within ``max_staleness`` rollout steps is
  used, so a prompt seen twice by one peer counts that peer's group once.
- A prompt that appears in several rows of the receiver's batch (an epoch that wraps
  inside one batch) gets the peers' statistics in every row; each row keeps its own
  group's rewards for the own mean.
- A prompt whose own group holds a NaN reward (a verifier that could not score) keeps the
  plain GRPO advantages the trainer computed, and is counted in ``nan_rows_skipped``.
- Std is Bessel-corrected and ``eps`` defaults to 1e-4, as the trainer's GRPO
  (``scale_rewards="group"``); ``alpha=0`` keeps plain GRPO's numerator to the last bit
  (a group of equal rewards gets exactly 0), and ``alpha=0, scale_source="own"``
  reproduces plain GRPO exactly (tested). A receiver must therefore use
  ``scale_rewards: group``.
- ``scale_source="own"`` with ``alpha > 0`` is refused at construction: the own std is 0
  on all-fail / all-succeed groups, so the baseline shift would be divided by eps alone.

Composition (see :mod:`mrl_lightning.callbacks`): probes run in callback-list order.
XGRPO *replaces* the receiver's own-sample advantages, computed from rewards (it does not
read the incoming ``batch.advantages``); PRP (:mod:`.prp`) does the same, so when both are
on, the one later in the list decides the own-sample advantages (PRP's peer loss stays
either way). SGT (``transfer_mode: nll``) only appends a loss term and composes with XGRPO in
any order; ``transfer_mode: group`` beside XGRPO is refused (:class:`~mrl_lightning.callbacks.SuccessGatedTransfer`).

Logged under ``probe/xgrpo/<policy>/``: ``baseline_shift`` (mean over prompts of
|b_i - mean R_i|, reward units), ``baseline_shift_max``, ``zero_var_groups`` (own groups
with all rewards equal), ``zero_var_signal_share`` (share of those given a non-zero
advantage; float rounding gives exactly 0, never a "signal"), ``prompts_with_peers``,
``peer_groups`` (records used, each once even when its prompt fills several rows),
``nan_rows_skipped``.
"""

from __future__ import annotations

import torch

from mrl_lightning.callbacks.base import MRLCallback, exchange_step
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import GroupStatsRecord
from mrl_lightning.metrics import Max, Mean, Sum
from mrl_lightning.probes.xgrpo import (
    SCALE_SOURCES,
    own_scale_problem,
    peer_moments_from_stats,
    peer_stats_from_records,
    xgrpo_from_moments,
    xgrpo_metrics,
)

# How XGRPO's scalars combine over a policy's ranks (mrl_lightning.metrics); the rest are means.
METRIC_KINDS = {"baseline_shift_max": Max, "zero_var_groups": Sum, "prompts_with_peers": Sum}


def advantage_probe_note(callbacks: list, me: MRLCallback) -> str | None:
    """One line saying which advantage-replacing probe wins, if more than one is listed.

    Args:
        callbacks: The run's callbacks, in list order (those with ``replaces_advantages`` count).
        me: The callback asking.

    Returns:
        The note when ``me`` is the last advantage-replacing probe and another one runs
        before it; otherwise None (so the note is printed once).
    """
    listed = [cb for cb in callbacks if getattr(cb, "replaces_advantages", False)]
    if len(listed) < 2 or listed[-1] is not me:
        return None
    earlier = ", ".join(type(cb).__name__ for cb in listed[:-1])
    return (f"[probes] {earlier} and {type(me).__name__} both replace own-sample advantages; "
            f"callbacks run in list order, so {type(me).__name__}'s advantages are used "
            "(auxiliary peer losses of earlier probes are kept).")


class CrossPolicyAdvantage(MRLCallback):
    """Cross-Policy GRPO Advantage Sharing (XGRPO) probe.

    Args:
        alpha: Weight of the union mean in the baseline b_i(x), in [0, 1]; 0 = own mean.
        scale_source: ``"union"`` (std of own + peer rewards) or ``"own"`` (own std; only
            with ``alpha: 0``, which is then plain GRPO).
        eps: Added to the scale s_i(x) (TRL's 1e-4, the trainer's GRPO default).
        max_staleness: Use peer group statistics at most this many rollout steps old;
            0 = the same step only; None = any the exchange still holds.
        receivers: Policies whose advantages are replaced; None = all.

    Raises:
        ConfigError: out-of-range values, or ``scale_source="own"`` with ``alpha > 0`` (all at once).
    """

    def __init__(
        self,
        alpha: float = 0.5,
        scale_source: str = "union",
        eps: float = 1e-4,
        max_staleness: int | None = 0,
        receivers: list[str] | None = None,
    ) -> None:
        errors = []
        if not 0.0 <= alpha <= 1.0:
            errors.append(f"CrossPolicyAdvantage.alpha={alpha!r} must be in [0, 1] (0 = own mean, 1 = union mean).")
        if scale_source not in SCALE_SOURCES:
            errors.append(f"CrossPolicyAdvantage.scale_source={scale_source!r}; valid: {list(SCALE_SOURCES)}.")
        elif scale_source == "own" and 0.0 < alpha <= 1.0:
            errors.append(f"CrossPolicyAdvantage: {own_scale_problem(alpha)}.")
        if not eps > 0:
            errors.append(f"CrossPolicyAdvantage.eps={eps!r} must be > 0 (e.g. 1e-4).")
        if max_staleness is not None and max_staleness < 0:
            errors.append(f"CrossPolicyAdvantage.max_staleness={max_staleness!r} must be >= 0 or null.")
        if errors:
            raise ConfigError("\n".join(errors))
        self.alpha, self.scale_source, self.eps = alpha, scale_source, eps
        self.max_staleness, self.receivers = max_staleness, receivers

    @property
    def see_reads(self) -> dict[str, int | None]:
        """Record type read from SEE -> how many steps back (checked by SharedExperienceExchange)."""
        return {"group_stats": self.max_staleness}

    requires = ("exchange",)
    replaces_advantages = True

    def config_errors(self, ctx, system) -> list[str]:
        """Unknown receivers, and receivers not on ``scale_rewards: group``."""
        errors = []
        names = list(system.policies)
        for name in self.receivers or []:
            if name not in names:
                errors.append(f"CrossPolicyAdvantage.receivers names policy {name!r}, which is not in "
                              f"model.policies {names}.")
        for name in self.receivers or names:
            scale = getattr(system.policies[name], "scale_rewards", "group") if name in names else "group"
            if scale != "group":
                errors.append(f"CrossPolicyAdvantage: policy {name!r} has scale_rewards={scale!r}, but XGRPO "
                              "scales per prompt (scale_source). Set scale_rewards: group for it, or leave it "
                              "out of CrossPolicyAdvantage.receivers.")
        return errors

    def setup(self, ctx, system, datamodule) -> None:
        note = advantage_probe_note(ctx.callbacks, self)
        if note:
            ctx.print(note)

    def peer_records(self, ctx, receiver: str, prompt_ids: list[str]) -> list[GroupStatsRecord]:
        """Newest GroupStatsRecord per (prompt, peer) within the staleness window (``ctx.exchange``)."""
        records = ctx.exchange.query(GroupStatsRecord, receiver=receiver, step=exchange_step(ctx),
                                         prompt_ids=prompt_ids, max_staleness=self.max_staleness)
        newest: dict[tuple[str, str], GroupStatsRecord] = {}
        for rec in records:  # publication order: on a tie in step the later record wins
            key = (rec.prompt_id, rec.source)
            if rec.n > 0 and (key not in newest or rec.step >= newest[key].step):
                newest[key] = rec
        return list(newest.values())

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        """Compose ``policy``'s batch: replace ``batch.advantages`` ``[B, G]`` by XGRPO's.

        Rows (prompts) with a NaN own reward keep the trainer's GRPO advantages; scalars go
        to ``batch.metrics``. Reads ``ctx.exchange`` and ``ctx.rollout_step``.
        """
        name = policy.policy_name
        if self.receivers is not None and name not in self.receivers:
            return
        tag = f"probe/xgrpo/{name}"
        rewards = batch.scored.rewards
        prompt_ids = [x.prompt_id for x in batch.scored.items]
        records = self.peer_records(ctx, name, prompt_ids)
        rows = torch.isfinite(rewards).all(dim=1)
        own = rewards[rows]
        kept_ids = [pid for pid, ok in zip(prompt_ids, rows.tolist()) if ok]
        if own.shape[0] == 0:
            batch.metrics.update({f"{tag}/nan_rows_skipped": Sum(len(prompt_ids)), f"{tag}/peer_groups": Sum(0.0)})
            return
        count, mean, std = peer_stats_from_records(records, kept_ids)
        peer = peer_moments_from_stats(count, mean, std)
        advantages, baseline, _ = xgrpo_from_moments(own, peer, self.alpha, self.scale_source, self.eps)
        new = batch.advantages.clone()
        new[rows] = advantages.to(new.dtype)
        batch.advantages = new
        for key, value in xgrpo_metrics(own, advantages, baseline, peer[0]).items():
            short = key.removeprefix("probe/xgrpo_")
            batch.metrics[f"{tag}/{short}"] = METRIC_KINDS.get(short, float)(value)
        m = batch.metrics  # means over prompts, and over the zero-variance groups: weighted by their counts
        m[f"{tag}/baseline_shift"] = Mean(m[f"{tag}/baseline_shift"], own.shape[0])
        m[f"{tag}/zero_var_signal_share"] = Mean(m[f"{tag}/zero_var_signal_share"], m[f"{tag}/zero_var_groups"])
        kept = set(kept_ids)  # a record shared by two copies of one prompt counts once
        m[f"{tag}/peer_groups"] = Sum(sum(rec.prompt_id in kept for rec in records))
        m[f"{tag}/nan_rows_skipped"] = Sum(len(prompt_ids) - own.shape[0])
