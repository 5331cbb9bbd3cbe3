"""PeerRolloutPooling callback: PRP on top of GRPO (docs/probes.md).

Thin adapter over :mod:`mrl_lightning.probes.prp` and THL. For receiver i and each of its
prompts x it takes up to M peer ``RolloutRecord`` s (source j != i) from SEE
(``ctx.exchange``), retokenizes each completion into i's tokens behind i's *own*
prompt ids (as i's rollouts had them; a peer completion that stopped ends with i's own
end-of-turn token) and maps j's sampling log-probs onto those tokens
(:func:`mrl_lightning.thl.transfer_trace`). Then:

1. Advantages over the pooled group own G + peer M (:func:`prp_pooled_advantages`, the
   policy's ``scale_rewards``, eps 1e-4): the own part replaces ``batch.advantages``. A
   prompt with no pooled peer gets plain GRPO advantages
   (:func:`~mrl_lightning.objectives.grpo.group_advantages`), bit for bit.
2. i's log-probs of the peer tokens before the update (``logp_recv``) are taken, detached,
   from the peer loss's own first forward pass (the weights have not moved yet then, so
   they equal a separate no-gradient pass bit for bit, at no extra forward); later inner
   iterations reuse them. The peer loss is the decoupled-PPO surrogate of the module
   :mod:`mrl_lightning.probes.prp` with weights ``is_mode`` / ``is_level`` / ``c``, appended
   to ``batch.aux_losses`` and weighted by ``lambda_prp``. With ``lambda_prp = 0`` (no loss)
   ``logp_recv`` is computed when the batch is composed, for the weight metrics alone.

The peer unit loss is the receiver's own ``loss_type`` term at its own
``importance_sampling_level`` (and its ``delta``, SAPO / VESPO options), on the ratio to the
receiver at compose time, times the importance weight (:func:`prp_token_losses`), so every
loss type of docs/grpo.md pools.

Normalization (a choice made here): the peer token losses are aggregated with the
*own* batch's normalizer for the policy's ``loss_type`` (own sequences for ``grpo``,
``sapo``, ``luspo`` and ``dr_grpo``, own counted tokens for ``bnpo`` / ``dapo`` / ``cispo`` /
``vespo``), so with ``lambda_prp = 1`` a peer sample weighs exactly what an own sample weighs. Two identical policies with one tokenizer
then give (N_own + N_peer) / N_own times the GRPO loss over the pooled group of G + M
(same gradient direction; tested): exact equality would need the trainer to scale the own
GRPO loss too. The peer tokens get no KL term (``beta`` applies to own samples only), and
samples are skipped (counted in ``retokenize_failures``) when THL cannot spell the text
exactly on both sides or the mapped completion is empty.

Composition (see :mod:`mrl_lightning.callbacks`): probes run in callback-list order. PRP
*replaces* own-sample advantages from rewards (it does not read the incoming
``batch.advantages``); XGRPO does too, so with both on, the later one in the list decides
the own-sample advantages, while PRP's peer loss always stays. SGT only appends a loss.

Logged under ``probe/prp/<policy>/``: ``peers_pooled``, ``prompts_with_peers``,
``retokenize_failures``, ``nan_rows_skipped``, weight statistics (``ess``, ``ess_raw``,
``log_ratio_mean``, ``log_ratio_max``, ``log_ratio_abs_max`` in nats, ``weight_mean``,
``frac_capped``, ``units``) and ``loss``; the THL residual of the pooled samples under
``thl/prp/<policy>/`` (:func:`mrl_lightning.thl.residual_metrics`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mrl_lightning.update.batch import AuxiliaryLoss
from mrl_lightning.callbacks.base import MRLCallback, exchange_step, prepare_thl
from mrl_lightning.callbacks.xgrpo import advantage_probe_note
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import RolloutRecord
from mrl_lightning.metrics import Sum
from mrl_lightning.objectives.grpo import aggregate_loss, group_advantages
from mrl_lightning.objectives.loss_types import OPTION_DEFAULTS
from mrl_lightning.probes.prp import (
    IS_LEVELS,
    IS_MODES,
    prp_pooled_advantages,
    prp_token_losses,
    prp_weight_metrics,
)
from mrl_lightning.rollout.base import left_pad
from mrl_lightning.thl import residual_metrics, transfer_trace
from mrl_lightning.update.policy_update import loss_counts


def own_unit_loss(token_losses: Tensor, mask: Tensor, loss_type: str, own_sequences: int, own_tokens: float,
                  max_completion_length: int) -> Tensor:
    """Peer token losses aggregated as ``loss_type`` aggregates, with the *own* batch's normalizers (docs/grpo.md,
    "Aggregation"; docs/probes.md).

    Args:
        token_losses: ``[M, L]`` float, per-token peer losses (0 where masked).
        mask: ``[M, L]`` bool, True = counted.
        loss_type: Any of docs/grpo.md's eight: ``grpo`` / ``sapo`` (per-sequence token mean, / own
            sequences), ``luspo`` (per-sequence sum, / own sequences), ``bnpo`` / ``dapo`` / ``cispo`` /
            ``vespo`` (/ own counted tokens) or ``dr_grpo`` (/ own sequences * max_completion_length).
        own_sequences: N, the receiver's own sequences this step.
        own_tokens: Its counted completion tokens.
        max_completion_length: The policy's L (``dr_grpo`` only).

    Returns:
        Scalar loss.

    Raises:
        ValueError: unknown ``loss_type``.
    """
    return aggregate_loss(token_losses, mask, loss_type, max_completion_length, num_sequences=own_sequences,
                          num_tokens=float(own_tokens))


class _PRPPeerLoss(AuxiliaryLoss):
    """The auxiliary peer loss of one receiver's step (called once per inner iteration; no share bound)."""

    name = "prp"

    def __init__(self, tensors: dict[str, Tensor], probe: PeerRolloutPooling, weight: float, tag: str) -> None:
        self.t, self.probe, self.weight, self.tag = tensors, probe, weight, tag
        self.first_metrics: dict[str, float] = {}  # the weight statistics, from the first call

    def __call__(self, policy, model, totals: dict[str, float]) -> tuple[Tensor, dict[str, float]]:
        device = next(policy.model.parameters()).device
        t = {k: v.to(device) for k, v in self.t.items()}
        logp, _ = policy.completion_logprobs(t["prompt_ids"], t["prompt_mask"], t["completion_ids"],
                                             t["completion_mask"], model=model)
        p = self.probe
        if "logp_recv" not in t:  # first call, before any optimizer step of this batch: the receiver's log-probs
            recv = torch.where(t["completion_mask"], logp.detach().float(), torch.zeros_like(logp, dtype=torch.float32))
            self.t["logp_recv"] = t["logp_recv"] = recv
            self.first_metrics = p.weight_metrics(recv.cpu(), self.t["logp_src"], self.t["loss_mask"], self.tag)
        options = {k: v for k, v in policy.loss_options().items() if k in OPTION_DEFAULTS and not k.startswith("eps")}
        losses = prp_token_losses(logp, t["logp_recv"], t["logp_src"], t["loss_mask"], t["advantages"],
                                  p.is_mode, p.is_level, p.c, policy.epsilon, policy.epsilon_high,
                                  loss_type=policy.loss_type,
                                  importance_sampling_level=policy.importance_sampling_level, **options)
        # The own batch's normalizers, summed over the policy's ranks when data-parallel.
        loss = self.weight * own_unit_loss(losses, t["loss_mask"], policy.loss_type, int(totals.get("sequences", 0.0)),
                                           float(totals.get("tokens", 0.0)), policy.max_completion_length)
        return loss, {**self.first_metrics, f"{self.tag}/loss": Sum(float(loss.detach()))}


class PeerRolloutPooling(MRLCallback):
    """Peer Rollout Pooling (PRP) probe.

    Args:
        max_peers_per_prompt: M, peer rollouts pooled per prompt (newest step first,
            alternating between peers).
        is_mode: Importance-weight mode: ``"truncate"`` min(rho, c), ``"clip"`` to
            [1/c, c], ``"none"`` (rho = 1) (docs/probes.md).
        is_level: ``"token"`` (one weight per token) or ``"sequence"`` (rho = product over
            the sequence's tokens).
        c: Cap of the weight, > 0 (> 1 for ``clip`` to differ from ``none``).
        lambda_prp: Peer loss weight; 1 = a peer sample weighs what an own sample weighs.
        lambda_per_policy: Optional per-receiver overrides of ``lambda_prp`` by name.
        max_staleness: Use peer rollouts at most this many rollout steps old; 0 = the same
            step only; None = any the exchange still holds.
        sources: Policies whose rollouts may be pooled; None = every peer.
        receivers: Policies that pool peer rollouts; None = all.
        eps: Added to the pooled std (TRL's 1e-4, the trainer's GRPO default).

    Raises:
        ConfigError: out-of-range values (all at once).
    """

    def __init__(
        self,
        max_peers_per_prompt: int = 4,
        is_mode: str = "truncate",
        is_level: str = "token",
        c: float = 1.0,
        lambda_prp: float = 1.0,
        lambda_per_policy: dict[str, float] | None = None,
        max_staleness: int | None = 0,
        sources: list[str] | None = None,
        receivers: list[str] | None = None,
        eps: float = 1e-4,
    ) -> None:
        errors = []
        if max_peers_per_prompt < 1:
            errors.append(f"PeerRolloutPooling.max_peers_per_prompt={max_peers_per_prompt} must be >= 1 (M).")
        if is_mode not in IS_MODES:
            errors.append(f"PeerRolloutPooling.is_mode={is_mode!r}; valid: {list(IS_MODES)}.")
        if is_level not in IS_LEVELS:
            errors.append(f"PeerRolloutPooling.is_level={is_level!r}; valid: {list(IS_LEVELS)}.")
        if not c > 0 or (is_mode == "clip" and c < 1):
            errors.append(f"PeerRolloutPooling.c={c!r} must be > 0, and >= 1 with is_mode='clip' (weights are "
                          "clamped to [1/c, c]); e.g. c: 2.0.")
        if lambda_prp < 0 or any(v < 0 for v in (lambda_per_policy or {}).values()):
            errors.append(f"PeerRolloutPooling.lambda_prp must be >= 0; got {lambda_prp}, {lambda_per_policy}.")
        if max_staleness is not None and max_staleness < 0:
            errors.append(f"PeerRolloutPooling.max_staleness={max_staleness!r} must be >= 0 or null.")
        if not eps > 0:
            errors.append(f"PeerRolloutPooling.eps={eps!r} must be > 0 (e.g. 1e-4).")
        if errors:
            raise ConfigError("\n".join(errors))
        self.max_peers_per_prompt, self.is_mode, self.is_level, self.c = max_peers_per_prompt, is_mode, is_level, c
        self.lambda_prp, self.lambda_per_policy = lambda_prp, dict(lambda_per_policy or {})
        self.max_staleness, self.sources, self.receivers, self.eps = max_staleness, sources, receivers, eps

    @property
    def see_reads(self) -> dict[str, int | None]:
        """Record type read from SEE -> how many steps back (checked by SharedExperienceExchange)."""
        return {"rollout": self.max_staleness}

    requires = ("exchange",)
    replaces_advantages = True
    reads_failed_rollouts = True

    def config_errors(self, ctx, system) -> list[str]:
        """Unknown policy names, and ``scale_rewards: batch`` on a policy with several ranks or with
        ``filter_groups`` (PRP's pooled std would count groups the update does not train on)."""
        errors = []
        names = list(system.policies)
        for field in ("lambda_per_policy", "sources", "receivers"):
            for name in getattr(self, field) or []:
                if name not in names:
                    errors.append(f"PeerRolloutPooling.{field} names policy {name!r}, which is not in "
                                  f"model.policies {names}.")
        errors += self._data_parallel_errors(getattr(ctx, "placement", None), system)
        for name, policy in system.policies.items():
            if getattr(policy, "filter_groups", False) and policy.scale_rewards == "batch" \
                    and (self.receivers is None or name in self.receivers):
                errors.append(f"PeerRolloutPooling: policy {name!r} has scale_rewards='batch' and filter_groups: true; "
                              "PRP's pooled reward std covers every sampled group, also those dynamic sampling drops "
                              "before the update, so it would differ from the kept groups' std plain GRPO uses. Use "
                              "scale_rewards: group (or none) for it, or filter_groups: false.")
            weight = self.lambda_per_policy.get(name, self.lambda_prp)
            if getattr(policy, "fsdp", False) and weight == 0 and (self.receivers is None or name in self.receivers):
                errors.append(f"PeerRolloutPooling: policy {name!r} has fsdp=true and a peer-loss weight of 0 "
                              "(lambda_prp / lambda_per_policy); with weight 0 PRP scores the pooled peers while "
                              "composing, a forward that only the ranks with peers would run, which a sharded model "
                              "cannot do. Give it a weight > 0, or fsdp: false.")
        return errors

    def _data_parallel_errors(self, placement, system) -> list[str]:
        """PRP's pooled std with ``scale_rewards: batch`` is per rank: refuse it for a policy on several ranks."""
        if placement is None:
            return []
        return [f"PeerRolloutPooling: policy {name!r} has scale_rewards='batch' and {len(ranks)} data-parallel ranks; "
                "PRP's pooled reward std is computed on each rank's own prompts, so the ranks would not take the "
                "one-rank step. Use scale_rewards: group (or none) for it, or give it one rank."
                for name, ranks in placement.groups.items()
                if len(ranks) > 1 and (self.receivers is None or name in self.receivers)
                and system.policies[name].scale_rewards == "batch"]

    def setup(self, ctx, system, datamodule) -> None:
        note = advantage_probe_note(ctx.callbacks, self)
        if note:
            ctx.print(note)
        prepare_thl(ctx, system, self.receivers)  # THL's tables now, not in the first step that pools

    def select(self, records: list[RolloutRecord], system) -> dict[str, list[RolloutRecord]]:
        """Up to M records per prompt: newest step first, alternating between sources."""
        by_prompt: dict[str, dict[str, list[RolloutRecord]]] = {}
        for rec in sorted(records, key=lambda r: -r.step):  # stable: publication order within a step
            if rec.source not in system.policies or (self.sources is not None and rec.source not in self.sources):
                continue
            if rec.reward != rec.reward:  # NaN: no verifier scored it, cannot be pooled
                continue
            by_prompt.setdefault(rec.prompt_id, {}).setdefault(rec.source, []).append(rec)
        out = {}
        for pid, per_source in by_prompt.items():
            queues, chosen = [list(q) for q in per_source.values()], []
            while len(chosen) < self.max_peers_per_prompt and any(queues):
                for q in queues:
                    if q and len(chosen) < self.max_peers_per_prompt:
                        chosen.append(q.pop(0))
            out[pid] = chosen
        return out

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        """Compose ``policy``'s batch (docs/loop.md): pool peers, replace own advantages, append the peer loss.

        Args:
            ctx: The :class:`~mrl_lightning.callbacks.base.HookContext` (``exchange``, ``rollout_step``, ``fabric``).
            system: Gives ``policies`` (each peer's tokenizer, for THL).
            policy: The receiver i.
            batch: i's :class:`~mrl_lightning.update.batch.TrainBatch`; ``advantages [B, G]`` is
                replaced for prompts with finite own rewards, one loss term is appended to
                ``aux_losses`` when a peer was pooled, and scalars go to ``metrics``.

        Raises:
            TypeError: a tokenizer is not a fast tokenizer (THL needs offsets and bytes).
        """
        name = policy.policy_name
        if self.receivers is not None and name not in self.receivers:
            return
        tag = f"probe/prp/{name}"
        scored, tok = batch.scored, policy.tokenizer
        prompt_ids = [x.prompt_id for x in scored.items]
        records = ctx.exchange.query(RolloutRecord, receiver=name, step=exchange_step(ctx),
                                         prompt_ids=prompt_ids, max_staleness=self.max_staleness)
        chosen = self.select(records, system)
        rows = torch.isfinite(scored.rewards).all(dim=1)
        traces, peers, failures = [], [], 0
        for b, pid in enumerate(prompt_ids):
            if not bool(rows[b]):
                continue
            for rec in chosen.get(pid, []):
                producer = system.policies[rec.source]
                trace = transfer_trace(producer.tokenizer, rec.token_ids, rec.logprobs, tok,
                                       scored.prompt_texts[b], rec.completion_text,  # "eos": older records
                                       add_eos=rec.finish_reason in ("stop", "eos"), eos_id=policy.end_of_turn_id,
                                       stop=producer.stop or (),
                                       include_stop_str_in_output=producer.include_stop_str_in_output)
                traces.append(trace)
                if not trace.round_trip_ok or not trace.retokenized.completion_ids:
                    failures += 1
                    continue
                peers.append((b, trace, rec))
        metrics = {f"{tag}/peers_pooled": Sum(len(peers)), f"{tag}/retokenize_failures": Sum(failures),
                   f"{tag}/prompts_with_peers": Sum(len({b for b, _, _ in peers})),
                   f"{tag}/nan_rows_skipped": Sum(float((~rows).sum()))}
        metrics.update(residual_metrics(traces, prefix=f"thl/prp/{name}/"))
        batch.metrics.update(metrics)
        if not peers:  # a pooled group of G + 0: plain GRPO, so an earlier probe's advantages never leak
            batch.advantages = group_advantages(scored.rewards, policy.scale_rewards, self.eps)
            return
        self._pool(policy, batch, rows, peers, tag, ctx)

    def _pool(self, policy, batch, rows: Tensor, peers: list, tag: str, ctx=None) -> None:
        """Pooled advantages, no-grad receiver log-probs, weight metrics and the peer loss."""
        scored, tok = batch.scored, policy.tokenizer
        slots: dict[int, list[int]] = {}
        for k, (b, _, _) in enumerate(peers):
            slots.setdefault(b, []).append(k)
        width = max(len(v) for v in slots.values())
        peer_r = torch.zeros(scored.rewards.shape[0], width, dtype=scored.rewards.dtype)
        peer_mask = torch.zeros_like(peer_r, dtype=torch.bool)
        for b, ks in slots.items():
            for slot, k in enumerate(ks):
                peer_r[b, slot], peer_mask[b, slot] = peers[k][2].reward, True
        kept = rows.nonzero().squeeze(1)
        own_adv, peer_adv = prp_pooled_advantages(scored.rewards[kept], peer_r[kept], peer_mask[kept],
                                                  policy.scale_rewards, self.eps)
        new = batch.advantages.clone()
        new[kept] = own_adv.to(new.dtype)
        # A prompt with no pooled peer: plain GRPO over the whole own batch, as the trainer computed it
        # (with scale_rewards "batch" the std also counts the scored rewards of rows skipped for a NaN).
        no_peer = rows & ~peer_mask.any(1)
        plain = group_advantages(scored.rewards, policy.scale_rewards, self.eps)
        new[no_peer] = plain[no_peer].to(new.dtype)
        batch.advantages = new
        full_peer_adv = torch.zeros_like(peer_r)
        full_peer_adv[kept] = peer_adv.to(peer_r.dtype)
        advantages = torch.tensor([float(full_peer_adv[b, slots[b].index(k)]) for k, (b, _, _) in enumerate(peers)])

        prompts = [scored.own_prompt_ids(b) for b, _, _ in peers]  # the receiver's own, as its rollouts had them
        p_ids, p_mask = left_pad(prompts, tok.pad_token_id)
        length = max(len(tr.retokenized.completion_ids) for _, tr, _ in peers)
        c_ids = torch.full((len(peers), length), tok.pad_token_id, dtype=torch.long)
        c_mask = torch.zeros(len(peers), length, dtype=torch.bool)
        logp_src = torch.zeros(len(peers), length, dtype=torch.float32)
        for k, (_, tr, _) in enumerate(peers):
            n = len(tr.retokenized.completion_ids)
            c_ids[k, :n] = torch.tensor(tr.retokenized.completion_ids, dtype=torch.long)
            c_mask[k, :n] = True
            logp_src[k, :n] = torch.tensor(tr.logprobs, dtype=torch.float32)
        loss_mask = c_mask.clone()
        if policy.mask_truncated_completions:
            loss_mask &= torch.tensor([rec.finish_reason != "length" for _, _, rec in peers]).unsqueeze(1)
        weight = self.lambda_per_policy.get(policy.policy_name, self.lambda_prp)
        if weight > 0:  # the peer loss's first forward gives the receiver's log-probs and the weight metrics
            if not batch.counts:  # composed outside the loop (tests): the own batch's normalizers
                batch.counts.update(loss_counts(policy, scored.rollouts))
            tensors = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask,
                       "loss_mask": loss_mask, "logp_src": logp_src, "advantages": advantages}
            batch.aux_losses.append(_PRPPeerLoss(tensors, self, weight, tag))
            return
        fabric = getattr(ctx, "fabric", None)
        with fabric.autocast() if fabric is not None else contextlib.nullcontext():  # the update's precision
            logp_recv = self._receiver_logprobs(policy, p_ids, p_mask, c_ids, c_mask)
        logp_recv = torch.where(c_mask, logp_recv, torch.zeros_like(logp_recv))
        batch.metrics.update(self.weight_metrics(logp_recv, logp_src, loss_mask, tag))

    def weight_metrics(self, logp_recv: Tensor, logp_src: Tensor, loss_mask: Tensor, tag: str) -> dict[str, float]:
        """Importance-weight statistics of the pooled peer tokens, under ``<tag>/`` (``ess``, ``log_ratio_max``, ...)."""
        return {f"{tag}/{key.removeprefix('probe/prp_')}": value
                for key, value in prp_weight_metrics(logp_recv, logp_src, loss_mask, self.is_mode, self.is_level,
                                                     self.c).items()}

    @staticmethod
    @torch.no_grad()
    def _receiver_logprobs(policy, p_ids: Tensor, p_mask: Tensor, c_ids: Tensor, c_mask: Tensor) -> Tensor:
        """i's log-probs of the peer tokens at compose time: ``[M, L]`` float32 nats, no grad."""
        device = next(policy.model.parameters()).device
        micro = policy.micro_batch_size or c_ids.shape[0]
        out = []
        for i in range(0, c_ids.shape[0], micro):
            sl = slice(i, i + micro)
            logp, _ = policy.completion_logprobs(p_ids[sl].to(device), p_mask[sl].to(device), c_ids[sl].to(device),
                                                 c_mask[sl].to(device))
            out.append(logp.float().cpu())
        return torch.cat(out)
