"""One policy's update on its composed batch: ``num_iterations`` optimizer steps (docs/grpo.md, docs/loop.md).

:func:`policy_update` reads, in the order it runs:

0. once per batch: the reference model's log-probs (``beta > 0``; for a LoRA policy its own
   base with the adapter disabled);
1. the GRPO loss forward and backward per micro-batch of ``micro_batch_size`` sequences,
   each divided by the whole group's normalizers (``batch.group_counts``: sequences and
   tokens over the policy's ranks), so any split and any number of ranks give one gradient;
   for rollouts another engine sampled (``sampling_logprobs`` set: vLLM, or mixed precision)
   the first iteration's forward also gives the old log-probs, with the sampler mismatch
   corrected (:class:`~mrl_lightning.rollout.sampler_correction.SamplerCorrection`, docs/rollout.md);
2. the group's gradient reduction (``reduce_gradients``: a sum over the policy's ranks);
3. the probes' auxiliary terms, each backpropagated and reduced on its own, and each term's
   share of the update bounded by its ``max_grad_share``, measured on the group-reduced
   gradients, so k ranks bound what one rank on the whole batch would
   (:mod:`mrl_lightning.objectives.aux_share`); a term with ``fused_scale`` set instead joins
   step 1's last micro-batch, its loss times that factor (docs/probes.md, "Cost");
4. the non-finite skip (NaN/inf gradient: no step, :func:`mrl_lightning.numerics.skip_nonfinite_update`);
5. clipping to ``max_grad_norm``;
6. the learning-rate warm-up and the optimizer step, counted on the policy
   (:meth:`~mrl_lightning.policy.PolicyModule.note_optimizer_step`).

Shapes: N sequences on this rank, L completion length.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch import Tensor

from mrl_lightning.batch import AuxiliaryLoss, TrainBatch
from mrl_lightning.metrics import Max, Mean, Min, Sum
from mrl_lightning.numerics import gradient_norm, skip_nonfinite_update
from mrl_lightning.objectives.aux_share import backward_aux_losses
from mrl_lightning.objectives.grpo import group_advantages, grpo_loss, masked_mean
from mrl_lightning.policy import PolicyModule
from mrl_lightning.rollout.sampler_correction import SamplerCorrection

Reduce = Callable[[list[torch.nn.Parameter]], None]


def loss_mask(policy: PolicyModule, rollouts) -> Tensor:
    """``[N, L]`` bool: the completion tokens the GRPO loss counts (``mask_truncated_completions`` applied)."""
    mask = rollouts.completion_mask.clone()
    if policy.mask_truncated_completions:
        mask &= ~rollouts.truncated.to(mask.device).unsqueeze(1)
    return mask


def loss_counts(policy: PolicyModule, rollouts) -> dict[str, float]:
    """This rank's loss normalizers: ``sequences`` (N) and counted ``tokens``."""
    return {"sequences": float(rollouts.completion_ids.shape[0]), "tokens": float(loss_mask(policy, rollouts).sum())}


def warmup_learning_rate(policy: PolicyModule, optimizer) -> float:
    """Set every param group's lr for the coming step of ``optimizer`` (``warmup_steps``); return it.

    Step k (0-based: the optimizer's state holds k steps so far) uses
    ``learning_rate * min(1, (k + 1) / warmup_steps)`` (TRL ``warmup_steps``, without its
    decay). Without warm-up the lr is left as it is.
    """
    if not policy.warmup_steps:
        return policy.learning_rate
    taken = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None:
                taken = max(taken, int(step))
    lr = policy.learning_rate * min(1.0, (taken + 1) / policy.warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def new_train_batch(policy: PolicyModule, scored, group_sum: Callable[[dict], dict] | None = None,
                    group_size: int = 1) -> TrainBatch:
    """The policy's batch before the probes: plain GRPO advantages and this rank's loss normalizers.

    With ``scale_rewards: batch`` on a group of several ranks the std is the whole batch's,
    from the group's pooled moments (n, sum, sum of squares; Bessel-corrected), so k ranks
    scale as one rank on the whole batch (docs/grpo.md).

    Args:
        policy: The policy.
        scored: Its :class:`~mrl_lightning.batch.ScoredRollouts` on this rank.
        group_sum: Sums a dict of floats over the policy's ranks (:meth:`~mrl_lightning.mwra.Workers.group_sum`).
        group_size: Ranks in the policy's group.
    """
    batch_std = None
    if policy.scale_rewards == "batch" and group_size > 1 and group_sum is not None:
        valid = scored.rewards[~torch.isnan(scored.rewards)].double()
        moments = group_sum({"n": float(valid.numel()), "sum": float(valid.sum()), "sumsq": float(valid.pow(2).sum())})
        n = max(moments["n"], 1.0)
        var = max(moments["sumsq"] - moments["sum"] ** 2 / n, 0.0) / max(n - 1.0, 1.0)
        batch_std = torch.tensor(var, dtype=scored.rewards.dtype).sqrt()
    advantages = group_advantages(scored.rewards, policy.scale_rewards, batch_std=batch_std)
    return TrainBatch(scored, advantages, counts=loss_counts(policy, scored.rollouts))


def mark_for_rescoring(rollouts) -> None:
    """Let the update re-score ``rollouts`` in its own precision (mixed precision runs).

    Sampling (a KV-cache decode, under the same autocast for the ``hf`` engine) and the
    update's forward (one pass under Fabric's autocast, bf16 / fp16) round differently, so
    the first ratio would not be 1. Marking the sampler's log-probs as ``sampling_logprobs``
    makes the update take the old log-probs from its own first forward, in its own precision,
    and correct the sampler/trainer mismatch as for any other engine (docs/rollout.md,
    ``rollout/<p>/is_ratio_*``, ``abs_delta_logp``). Rollouts another engine sampled are
    marked already.
    """
    if rollouts.sampling_logprobs is None:
        rollouts.sampling_logprobs = rollouts.old_logprobs.clone()


def trainable(policy: PolicyModule) -> list[torch.nn.Parameter]:
    """The policy's parameters that the optimizer steps."""
    return [p for p in policy.model.parameters() if p.requires_grad]


def _autocast(fabric):
    return fabric.autocast() if hasattr(fabric, "autocast") else contextlib.nullcontext()


def policy_update(policy: PolicyModule, batch: TrainBatch, model, fabric, optimizer,
                  reduce_gradients: Reduce | None = None) -> dict[str, float]:
    """One policy's update on its composed batch, in the order of the module docstring.

    Args:
        policy: The policy.
        batch: Its :class:`~mrl_lightning.batch.TrainBatch` (``group_counts`` set by the loop
            on a data-parallel group; None = this rank is the whole group).
        model: The Fabric-wrapped model (``fabric.setup``) to run forward passes with.
        fabric: The Fabric instance (``backward``, ``clip_gradients``, ``autocast``).
        optimizer: The policy's Fabric-wrapped optimizer.
        reduce_gradients: Sums the ``.grad`` of the given parameters over the policy's group of
            ranks, in place (after the GRPO backward, and after each auxiliary term's); None = one rank.

    Returns:
        Metrics of the last iteration under ``train/<p>/`` (loss, KL, clip ratios, entropy,
        ratio range, grad norm, learning rate with warm-up), the auxiliary terms' (shares of
        the update, their own metrics), ``train/<p>/nonfinite_updates_skipped`` and
        ``train/<p>/aux_loss_time_s`` (seconds spent on the auxiliary terms: forward,
        backward, reduction and bound; for fused terms an upper bound on their part of the
        shared pass, :func:`_grpo_backward`), both summed over the iterations.

    Raises:
        NonFiniteError: too many non-finite updates in a row (:mod:`mrl_lightning.numerics`).
        ValueError: an auxiliary term's ``max_grad_share`` is not in (0, 1).
    """
    r = batch.scored.rollouts
    p = policy.policy_name
    n_local = r.completion_ids.shape[0]
    micro = policy.micro_batch_size or n_local
    slices = [slice(i, i + micro) for i in range(0, n_local, micro)]

    def logprobs(sl, module, entropy=False):
        with _autocast(fabric):  # one autocast region: its passes share one cast of each weight (docs/speed.md)
            return policy.completion_logprobs(r.prompt_ids[sl], r.prompt_mask[sl], r.completion_ids[sl],
                                              r.completion_mask[sl], model=module, with_entropy=entropy)

    ref = None
    if policy.beta > 0:  # the reference scores in the update's precision (autocast), like the policy
        module, off = (policy.model, policy.model.disable_adapter()) if policy.is_adapter \
            else (policy.ref_model, contextlib.nullcontext())  # LoRA: the base is the reference
        with torch.no_grad(), _autocast(fabric), off:
            ref = torch.cat([logprobs(sl, module)[0] for sl in slices])
    metrics: dict[str, float] = {}
    sampler_weights = None  # another engine sampled (vLLM, or mixed precision): docs/rollout.md
    correction = SamplerCorrection(policy, r) if r.sampling_logprobs is not None else None
    reduce = reduce_gradients or (lambda params: None)
    totals = batch.group_counts if batch.group_counts is not None else batch.counts
    aux_key, skip_key = f"train/{p}/aux_loss_time_s", f"train/{p}/nonfinite_updates_skipped"
    metrics[aux_key], metrics[skip_key] = 0.0, 0.0
    fused, measured = _split_fused(policy, batch)
    for iteration in range(policy.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        metrics.update(_grpo_backward(policy, batch, fabric, model, logprobs, slices, ref, sampler_weights,
                                      entropy=iteration == 0, fused=fused, totals=totals,
                                      correction=correction if iteration == 0 else None))
        if iteration == 0 and correction is not None:  # the first forward's log-probs are the old ones from here on
            sampler_weights, sampler_metrics = correction.finish()
            metrics.update(sampler_metrics)
        metrics[aux_key] += metrics.pop("_fused_time_s", 0.0)
        params = trainable(policy)
        reduce(params)
        if measured or batch.group_terms:  # a rank without a term still reduces the group's terms
            t0 = time.perf_counter()
            terms = _with_empty_shares(policy, batch, measured)
            metrics.update(backward_aux_losses(terms, policy, model, fabric.backward, params,
                                               tag=lambda term: f"probe/{term}/{p}", totals=totals, reduce=reduce,
                                               terms=batch.group_terms))
            metrics[aux_key] += time.perf_counter() - t0
        skipped = skip_nonfinite_update(policy, params)
        metrics[skip_key] += float(skipped)
        metrics[f"train/{p}/grad_norm"] = _clip_and_step(policy, params, model, fabric, optimizer, skipped, metrics)
    return metrics


class _EmptyShare(AuxiliaryLoss):
    """A term another rank of a sharded policy's group has and this one does not: a forward and a
    backward of weight 0 on one padding token, so that this rank runs the same FSDP collectives."""

    def __init__(self, name: str, max_grad_share: float | None) -> None:
        self.name, self.max_grad_share = name, max_grad_share

    def __call__(self, policy, model, totals):
        pad = torch.full((1, 1), policy.tokenizer.pad_token_id, dtype=torch.long)
        device = next(policy.model.parameters()).device
        ones = torch.ones((1, 1), dtype=torch.bool, device=device)
        logp, _ = policy.completion_logprobs(pad.to(device), ones, pad.to(device), ones, model=model)
        return logp.sum() * 0.0, {}


def _with_empty_shares(policy: PolicyModule, batch: TrainBatch, terms: list) -> list:
    """``terms``, plus an :class:`_EmptyShare` for each term name of the group this rank has none
    of when the policy is sharded (FSDP: every rank must run the same forward passes)."""
    if not policy.fsdp or not batch.group_terms:
        return terms
    mine = {aux.name for aux in terms}
    return list(terms) + [_EmptyShare(name, bound) for name, bound in batch.group_terms if name not in mine]


def _split_fused(policy: PolicyModule, batch: TrainBatch) -> tuple[list, list]:
    """The batch's auxiliary terms as ``(fused, measured)``: a term with ``fused_scale`` set and rows
    to share joins the last GRPO micro-batch, unless the policy is sharded or on several ranks
    (every rank must then run the same passes and reductions), where every term is measured."""
    if policy.fsdp or batch.group_terms:
        return [], list(batch.aux_losses)
    fused = [aux for aux in batch.aux_losses  # a term that defines rows (padded once, by _fused_forward)
             if getattr(aux, "fused_scale", None) is not None and type(aux).rows is not AuxiliaryLoss.rows]
    return fused, [aux for aux in batch.aux_losses if not any(aux is f for f in fused)]


def _join_rows(own: tuple[Tensor, ...], extra: list[tuple[Tensor, ...]], pad_id: int) -> tuple[Tensor, ...]:
    """Rows of one forward: ``own`` (``[m, P]`` prompts left-padded, ``[m, L]`` completions) then each
    of ``extra``, prompts left-padded and completions right-padded to the widest."""
    parts = [own] + extra
    width_p = max(part[0].shape[1] for part in parts)
    width_c = max(part[2].shape[1] for part in parts)
    device = own[0].device

    def fit(t: Tensor, width: int, left: bool, fill) -> Tensor:
        t = t.to(device)
        pad = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype, device=device)
        return torch.cat([pad, t] if left else [t, pad], dim=1)

    return (torch.cat([fit(x[0], width_p, True, pad_id) for x in parts]),
            torch.cat([fit(x[1], width_p, True, False) for x in parts]),
            torch.cat([fit(x[2], width_c, False, pad_id) for x in parts]),
            torch.cat([fit(x[3], width_c, False, False) for x in parts]))


def _grpo_backward(policy, batch, fabric, model, logprobs, slices, ref, sampler_weights, entropy: bool,
                   fused: list | None = None, totals: dict | None = None,
                   correction: SamplerCorrection | None = None) -> dict:
    """Step 1: the GRPO loss forward and backward per micro-batch; returns its metrics.

    Loss parts are divided by the group's totals, so they sum to the group's loss
    (:class:`~mrl_lightning.metrics.Sum`); the clip ratios, KL and entropy are means over
    this rank's counted tokens (:class:`~mrl_lightning.metrics.Mean` weighted by them).

    ``fused`` terms (:attr:`~mrl_lightning.batch.AuxiliaryLoss.fused_scale` set) add their rows
    to the last micro-batch's forward and ``fused_scale * loss`` to its loss, one backward for
    both. Their metrics come back with ``<prefix>/grad_scale`` (the factor used) and
    ``<prefix>/share_measured`` 0, and ``_fused_time_s``: the padding, their losses, and of
    the shared pass the part of its token positions (:func:`_pass_tokens`, padding included)
    that the GRPO rows alone would not have had; with a cost per position plus a fixed cost
    per pass, that part bounds their marginal cost from above.

    ``correction`` (first iteration of rollouts another engine sampled): each micro-batch's old
    log-probs and importance weights come from its own forward (:class:`SamplerCorrection`).
    """
    r, p = batch.scored.rollouts, policy.policy_name
    advantages = batch.advantages.reshape(r.completion_ids.shape[0]).to(r.old_logprobs.device)
    mask = loss_mask(policy, r)
    group = batch.group_counts or loss_counts(policy, r)
    n_seq, n_tokens = int(group["sequences"]), max(float(group["tokens"]), 1.0)
    local_tokens = float(mask.sum().clamp(min=1))
    sums = {"loss": 0.0, "kl": 0.0, "clip_low": 0.0, "clip_high": 0.0, "entropy": 0.0}
    ratios: list[float] = []
    fused_metrics: dict[str, float] = {}
    for i, sl in enumerate(slices):
        extra_loss, t0 = None, time.perf_counter()
        if fused and i == len(slices) - 1:
            logp, ent, extra_loss, fused_metrics = _fused_forward(policy, batch, model, sl, fused, totals or {},
                                                                  entropy)
        else:
            logp, ent = logprobs(sl, model, entropy=entropy)
        old, weights = r.old_logprobs[sl], None if sampler_weights is None else sampler_weights[sl]
        if correction is not None:
            old, weights = correction.take(sl, logp)
        out = grpo_loss(
            logp, old, advantages[sl], mask[sl], loss_type=policy.loss_type,
            epsilon=policy.epsilon, epsilon_high=policy.epsilon_high, beta=policy.beta,
            use_bias_correction_kl=policy.use_bias_correction_kl, kl_log_ratio_clamp=policy.kl_log_ratio_clamp,
            ref_logp=None if ref is None else ref[sl], max_completion_length=policy.max_completion_length,
            num_sequences=n_seq, num_tokens=n_tokens,
            sampler_weights=weights,
        )
        if extra_loss is None:
            fabric.backward(out.loss)
        else:
            fabric.backward(out.loss + extra_loss)
            own_s = fused_metrics["_fused_time_s"]  # padding and the terms' losses; then their part of the pass
            fused_metrics["_fused_time_s"] = own_s + (time.perf_counter() - t0 - own_s) * fused_metrics.pop(
                "_fused_grid_share")
        share = float(mask[sl].sum()) / local_tokens
        sums["loss"] += float(out.loss.detach())
        sums["clip_low"] += float(masked_mean(out.clipped_low.float(), mask[sl])) * share
        sums["clip_high"] += float(masked_mean(out.clipped_high.float(), mask[sl])) * share
        if out.kl is not None:
            sums["kl"] += float(masked_mean(out.kl.detach(), mask[sl])) * share
        if ent is not None:
            sums["entropy"] += float(masked_mean(ent, mask[sl])) * share
        if mask[sl].any():
            counted = out.ratio.detach()[mask[sl]]
            ratios += [float(counted.min()), float(counted.max())]
    weight = float(mask.sum())
    out_metrics = {
        f"train/{p}/loss": Sum(sums["loss"]),
        f"train/{p}/clip_ratio_low": Mean(sums["clip_low"], weight),
        f"train/{p}/clip_ratio_high": Mean(sums["clip_high"], weight),
        f"train/{p}/ratio_max": Max(max(ratios, default=1.0)), f"train/{p}/ratio_min": Min(min(ratios, default=1.0)),
    }
    if policy.beta > 0:
        out_metrics[f"train/{p}/kl_nats"] = Mean(sums["kl"], weight)
    if entropy:
        out_metrics[f"train/{p}/entropy_nats"] = Mean(sums["entropy"], weight)
    out_metrics.update(fused_metrics)
    return out_metrics


def _pass_tokens(prompt_ids: Tensor, prompt_mask: Tensor, width: int, shared: bool) -> int:
    """Token positions a forward over these rows computes (:func:`~mrl_lightning.forward.completion_logits`):
    each distinct prompt row once plus every row's completion width when ``shared``, else every row
    over prompt + completion."""
    n, p = prompt_ids.shape
    if not shared:
        return n * (p + width)
    distinct = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0).shape[0]
    return distinct * p + n * width


def _fused_forward(policy, batch, model, sl, fused: list, totals: dict, entropy: bool):
    """The last micro-batch's forward with the ``fused`` terms' rows appended.

    Returns:
        ``([m, L] GRPO rows' log-probs, [m, L] entropy or None, the terms' scaled loss summed,
        their metrics with "_fused_time_s" (padding and losses) and "_fused_grid_share")``.
    """
    t0 = time.perf_counter()
    r = batch.scored.rollouts
    own = (r.prompt_ids[sl], r.prompt_mask[sl], r.completion_ids[sl], r.completion_mask[sl])
    extra = [aux.rows() for aux in fused]
    p_ids, p_mask, c_ids, c_mask = _join_rows(own, extra, policy.tokenizer.pad_token_id)
    prep = time.perf_counter() - t0
    logp, ent = policy.completion_logprobs(p_ids, p_mask, c_ids, c_mask, model=model, with_entropy=entropy)
    t1 = time.perf_counter()
    m, length = own[2].shape
    loss, metrics, start = None, {}, m
    for aux, rows in zip(fused, extra):
        stop = start + rows[2].shape[0]
        term, term_metrics = aux.loss_from_logprobs(policy, logp[start:stop, : rows[2].shape[1]],
                                                    rows[3].to(logp.device), dict(totals))
        term = term * aux.fused_scale
        loss = term if loss is None else loss + term
        metrics.update(term_metrics)
        prefix = f"probe/{aux.name}/{policy.policy_name}"
        metrics[f"{prefix}/grad_scale"], metrics[f"{prefix}/share_measured"] = aux.fused_scale, 0.0
        start = stop
    metrics["_fused_time_s"] = prep + time.perf_counter() - t1
    shared = policy.share_prompt_forward and not (policy.gradient_checkpointing or policy.fsdp)
    alone = _pass_tokens(own[0], own[1], length, shared)
    metrics["_fused_grid_share"] = max(0.0, 1.0 - alone / _pass_tokens(p_ids, p_mask, c_ids.shape[1], shared))
    return logp[:m, :length], None if ent is None else ent[:m, :length], loss, metrics


def _clip_and_step(policy, params, model, fabric, optimizer, skipped: bool, metrics: dict) -> float:
    """Steps 5-6: clip (or measure) the gradient norm, warm the lr up and step, unless ``skipped``."""
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        return float("nan")
    if policy.max_grad_norm is not None:
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=policy.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: the mesh's
    elif policy.fsdp:
        grad_norm = gradient_norm(params)
    else:
        grads = [g.grad.detach().norm() for g in params if g.grad is not None]
        grad_norm = torch.stack(grads).norm() if grads else torch.zeros(())
    lr = warmup_learning_rate(policy, optimizer)
    if policy.warmup_steps:
        metrics[f"train/{policy.policy_name}/learning_rate"] = lr
    optimizer.step()
    policy.note_optimizer_step()  # an engine with its own weights (vLLM) pushes them before it samples again
    return float(grad_norm)
