"""One policy's update on its composed batch: ``num_iterations`` optimizer steps (docs/grpo.md, docs/loop.md).

:func:`policy_update` reads, in the order it runs:

0. once per batch: the reference model's log-probs (``beta > 0``; for a LoRA policy its own
   base with the adapter disabled);
1. the GRPO loss (the policy's ``loss_type`` and importance level, with the masks on the
   policy term: :func:`~mrl_lightning.update.grpo_terms.top_entropy_mask`, docs/grpo.md) forward and
   backward per micro-batch of ``micro_batch_size`` sequences, each divided by the whole
   group's normalizers (``batch.group_counts``: sequences and tokens over the policy's
   ranks), so any split and any number of ranks give one gradient; a rank with no rows
   (dynamic sampling kept none of its groups) holds a zero gradient; for rollouts another
   engine sampled (``sampling_logprobs`` set: vLLM, or mixed precision) the first iteration's
   forward also gives the old log-probs, with the sampler mismatch corrected
   (:class:`~mrl_lightning.rollout.sampler_correction.SamplerCorrection`, docs/rollout.md);
2. the group's gradient reduction (``reduce_gradients``: a sum over the policy's ranks);
3. the probes' auxiliary terms, each backpropagated and reduced on its own, and each term's
   share of the update bounded by its ``max_grad_share``, measured on the group-reduced
   gradients, so k ranks bound what one rank on the whole batch would
   (:mod:`mrl_lightning.objectives.aux_share`); each term runs its own forward over its own
   rows only (SGT's few demos), so the bound is exact on every step (docs/probes.md, "Cost");
4. the non-finite skip (NaN/inf gradient: no step, :func:`mrl_lightning.model.numerics.skip_nonfinite_update`);
   then the empty skip (:func:`empty_update`): dynamic sampling kept no group on any of the policy's
   ranks and no probe term gave a gradient either, so there is nothing to train on and no
   optimizer step is taken (docs/grpo.md, "Dynamic sampling");
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

from mrl_lightning.update.batch import AuxiliaryLoss, TrainBatch
from mrl_lightning.update.grpo_terms import finish_loss_metrics, note_loss_stats, top_entropy_mask, zero_gradients
from mrl_lightning.metrics import Max, Mean, Min, Sum
from mrl_lightning.model.numerics import gradient_norm, skip_nonfinite_update
from mrl_lightning.objectives.aux_share import backward_aux_losses
from mrl_lightning.model.head_factors import factorable_weight
from mrl_lightning.objectives.grpo import group_advantages, grpo_loss, masked_mean
from mrl_lightning.objectives.loss_types import GRPO, LOSS_TYPES
from mrl_lightning.policy.module import PolicyModule
from mrl_lightning.rollout.sampler_correction import SamplerCorrection
from mrl_lightning.model.weight_casts import shared_casts

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
                    group_size: int = 1, keep: Tensor | None = None) -> TrainBatch:
    """The policy's batch before the probes: plain GRPO advantages and this rank's loss normalizers.

    With ``scale_rewards: batch`` on a group of several ranks the std is the whole batch's,
    from the group's pooled moments (n, sum, sum of squares; Bessel-corrected), so k ranks
    scale as one rank on the whole batch (docs/grpo.md). With ``keep`` (dynamic sampling) the
    normalizers and the batch std are the kept groups' (the groups the GRPO term trains on).

    Args:
        policy: The policy.
        scored: Its :class:`~mrl_lightning.update.batch.ScoredRollouts` on this rank.
        group_sum: Sums a dict of floats over the policy's ranks (:meth:`~mrl_lightning.mwra.Workers.group_sum`).
        group_size: Ranks in the policy's group.
        keep: ``[B]`` bool, the groups the GRPO term trains on (:mod:`mrl_lightning.loop.dynamic_sampling`); None = all.
    """
    batch_std = None
    trained = scored if keep is None else scored.select_groups([int(b) for b in torch.nonzero(keep).flatten()])
    if policy.scale_rewards == "batch" and (group_size > 1 or keep is not None):
        valid = trained.rewards[~torch.isnan(trained.rewards)].double()
        moments = {"n": float(valid.numel()), "sum": float(valid.sum()), "sumsq": float(valid.pow(2).sum())}
        moments = group_sum(moments) if group_sum is not None and group_size > 1 else moments
        n = max(moments["n"], 1.0)
        var = max(moments["sumsq"] - moments["sum"] ** 2 / n, 0.0) / max(n - 1.0, 1.0)
        batch_std = torch.tensor(var, dtype=scored.rewards.dtype).sqrt()
    advantages = group_advantages(scored.rewards, policy.scale_rewards, batch_std=batch_std)
    return TrainBatch(scored, advantages, counts=loss_counts(policy, trained.rollouts), keep=keep)


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


def sampling_precision(fabric, policies):
    """Fabric's autocast when the run is mixed precision and every one of ``policies`` samples with the
    ``hf`` engine: ``generate`` then decodes in the update's precision, each weight cast once per call
    (docs/speed.md); otherwise no context (float32 sampling, and vLLM in its own dtype)."""
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    if isinstance(fabric.strategy.precision, MixedPrecision) and all(p.rollout_engine == "hf" for p in policies):
        return fabric.autocast()
    return contextlib.nullcontext()


def trainable(policy: PolicyModule) -> list[torch.nn.Parameter]:
    """The policy's parameters that the optimizer steps."""
    return [p for p in policy.model.parameters() if p.requires_grad]


def _autocast(fabric):
    return fabric.autocast() if hasattr(fabric, "autocast") else contextlib.nullcontext()


MATH_ATTENTION_ROWS, MATH_ATTENTION_TOKENS = 8, 128
"""The largest auxiliary pass :func:`term_attention` gives the math kernel: 8 rows of at most 128 tokens. The
math kernel keeps each layer's attention scores for the backward (rows x heads x tokens^2, about 8.5 bytes
each: 10 MiB a layer there with 9 heads), where the flash kernel keeps none."""


def term_attention(fabric, terms: list, policy=None):
    """The attention kernel of the auxiliary terms' own passes: torch's math kernel for short passes on a CPU
    under mixed precision.

    SGT's pass runs a few short rows, its demos. There, on a CPU in bf16, the flash kernel's forward
    and backward took 1.5-3x the math kernel's (2 rows of 45 tokens: 6.9 ms against 2.3 ms with
    SmolLM2's heads, 3.9 against 2.6 with Gemma 3's; docs/speed.md, "Attention"). Only when every
    term declares a pass of at most :data:`MATH_ATTENTION_ROWS` rows of :data:`MATH_ATTENTION_TOKENS`
    tokens (``AuxiliaryLoss.pass_shape``): the math kernel keeps the scores the flash kernel does not,
    and on long rows it is slower. Elsewhere (float32, a GPU, PRP's peer rows, the GRPO batch) no
    kernel is chosen here, nor while a sampler thread runs beside the update (``policy.sampling_beside_update``,
    ``trainer.async_rollouts``): the choice is process-wide, so that thread's ``generate`` would round as the
    math kernel does at moments that depend on timing.
    """
    from lightning.fabric.plugins.precision.amp import MixedPrecision
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = getattr(getattr(fabric, "device", None), "type", None)
    precision = getattr(getattr(fabric, "strategy", None), "precision", None)
    if device != "cpu" or not isinstance(precision, MixedPrecision) or not terms \
            or getattr(policy, "sampling_beside_update", False):
        return contextlib.nullcontext()
    shapes = [getattr(term, "pass_shape", lambda: None)() for term in terms]  # a term of another kind: unknown
    if all(shape is not None and shape[0] <= MATH_ATTENTION_ROWS and shape[1] <= MATH_ATTENTION_TOKENS
           for shape in shapes):
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def empty_update(totals: dict[str, float], params: list[torch.nn.Parameter]) -> bool:
    """True when an optimizer step would have nothing to train on: skip it (docs/grpo.md, "Dynamic sampling").

    That is a step whose GRPO term has no row on any of the policy's ranks (dynamic sampling
    kept none of the step's groups: ``totals["sequences"]`` is 0, so there is no policy term and
    no KL term either) and whose probe terms add no gradient (none was appended, or each was
    bounded to 0 against the zero GRPO gradient). AdamW would still move the weights on such a
    step (its momentum and weight decay) and count it towards the warm-up, which DAPO, verl and
    TRL never do on an empty batch. A probe term that does carry a gradient (SGT with a
    ``grad_share_floor`` or no bound, PRP's peer loss) is stepped on as usual.

    Args:
        totals: The GRPO term's normalizers over the policy's group (``sequences``, ``tokens``); a
            batch without ``sequences`` (composed outside the loop) is never empty.
        params: The trainable parameters, their ``.grad`` already summed over the group (so every
            rank of the group decides alike).
    """
    if float(totals.get("sequences", 1.0)) != 0.0:
        return False
    return not any(p.grad is not None and bool(p.grad.detach().any()) for p in params)


def policy_update(policy: PolicyModule, batch: TrainBatch, model, fabric, optimizer,
                  reduce_gradients: Reduce | None = None, gather: Callable | None = None) -> dict[str, float]:
    """One policy's update on its composed batch, in the order of the module docstring.

    Args:
        policy: The policy.
        batch: Its :class:`~mrl_lightning.update.batch.TrainBatch` (``group_counts`` set by the loop
            on a data-parallel group; None = this rank is the whole group).
        model: The Fabric-wrapped model (``fabric.setup``) to run forward passes with.
        fabric: The Fabric instance (``backward``, ``clip_gradients``, ``autocast``).
        optimizer: The policy's Fabric-wrapped optimizer.
        reduce_gradients: Sums the ``.grad`` of the given parameters over the policy's group of
            ranks, in place (after the GRPO backward, and after each auxiliary term's); None = one rank.
        gather: An object from every rank of the policy's group, as a list (``Workers.group_gather``); the
            ``top_entropy_quantile`` threshold is taken over the group's tokens; None = one rank.

    Returns:
        Metrics of the last iteration under ``train/<p>/`` (loss, KL, clip ratios, entropy,
        ratio range, grad norm, learning rate with warm-up), the auxiliary terms' (shares of
        the update, their own metrics), ``train/<p>/nonfinite_updates_skipped``,
        ``train/<p>/empty_updates_skipped`` (optimizer steps not taken for want of anything to train
        on, :func:`empty_update`) and ``train/<p>/aux_loss_time_s`` (seconds spent on the auxiliary
        terms: forward, backward, reduction and bound), each summed over the iterations.

    Raises:
        NonFiniteError: too many non-finite updates in a row (:mod:`mrl_lightning.model.numerics`).
        ValueError: an auxiliary term's ``max_grad_share`` is not in (0, 1).
    """
    r = batch.scored.rollouts
    p = policy.policy_name
    n_local = r.completion_ids.shape[0]
    micro = policy.micro_batch_size or max(n_local, 1)
    slices = [slice(i, i + micro) for i in range(0, n_local, micro)]

    def logprobs(sl, module, entropy=False):
        with _autocast(fabric):  # one autocast region: its passes share one cast of each weight (docs/speed.md)
            return policy.completion_logprobs(r.prompt_ids[sl], r.prompt_mask[sl], r.completion_ids[sl],
                                              r.completion_mask[sl], model=module, with_entropy=entropy)

    ref = None
    if policy.beta > 0 and slices:  # the reference scores in the update's precision (autocast), like the policy
        module, off = (policy.model, policy.model.disable_adapter()) if policy.is_adapter \
            else (policy.ref_model, contextlib.nullcontext())  # LoRA: the base is the reference
        with torch.no_grad(), _autocast(fabric), off, shared_casts():
            ref = torch.cat([logprobs(sl, module)[0] for sl in slices])
    metrics: dict[str, float] = {}
    sampler_weights = None  # another engine sampled (vLLM, or mixed precision): docs/rollout.md
    correction = SamplerCorrection(policy, r) if r.sampling_logprobs is not None and slices else None
    reduce = reduce_gradients or (lambda params: None)
    totals = batch.group_counts if batch.group_counts is not None else batch.counts
    aux_key, skip_key = f"train/{p}/aux_loss_time_s", f"train/{p}/nonfinite_updates_skipped"
    empty_key = f"train/{p}/empty_updates_skipped"
    metrics[aux_key], metrics[skip_key], metrics[empty_key] = 0.0, 0.0, 0.0
    for iteration in range(policy.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        device = getattr(getattr(fabric, "device", None), "type", None)
        # this optimizer step's passes: one cast per weight (mrl_lightning/model/weight_casts.py)
        with shared_casts(None if policy.fsdp else device):
            entropy_mask = top_entropy_mask(policy, r, loss_mask(policy, r), model, gather)
            _fold(metrics, _grpo_backward(policy, batch, fabric, model, logprobs, slices, ref, sampler_weights,
                                          entropy=iteration == 0, entropy_mask=entropy_mask,
                                          correction=correction if iteration == 0 else None))
            if iteration == 0 and correction is not None:  # the first forward's log-probs are the old ones now
                sampler_weights, sampler_metrics = correction.finish()
                metrics.update(sampler_metrics)
            if not slices:  # no group on this rank (dynamic sampling): a zero gradient, as a rank with rows sums
                zero_gradients(trainable(policy))
            params = trainable(policy)
            reduce(params)
            if batch.aux_losses or batch.group_terms:  # a rank without a term still reduces the group's terms
                t0 = time.perf_counter()
                terms = _with_empty_shares(policy, batch, batch.aux_losses)
                with term_attention(fabric, terms, policy):
                    term_metrics = backward_aux_losses(
                        terms, policy, model, fabric.backward, params, tag=lambda term: f"probe/{term}/{p}",
                        totals=totals, reduce=reduce, terms=batch.group_terms,
                        # one rank (no group's terms): a large tied head's term gradient as its factors
                        # (mrl_lightning/model/head_factors.py)
                        factored_head=factorable_weight(policy) if batch.group_terms is None else None)
                _fold(metrics, term_metrics)
                metrics[aux_key] += time.perf_counter() - t0
        skipped = skip_nonfinite_update(policy, params)
        metrics[skip_key] += float(skipped)
        if not skipped and empty_update(totals, params):  # nothing moves: weights, moments, warm-up, step counts
            optimizer.zero_grad(set_to_none=True)
            metrics[empty_key] += 1.0
            metrics[f"train/{p}/grad_norm"] = 0.0
            continue
        metrics[f"train/{p}/grad_norm"] = _clip_and_step(policy, params, model, fabric, optimizer, skipped, metrics)
    return metrics


def _fold(metrics: dict, new: dict) -> None:
    """Add one inner iteration's metrics to ``metrics``: a :class:`Max` keeps the largest over the iterations
    and a :class:`Min` the smallest (a bound or a vanishing gradient shows whichever optimizer step it was
    on), anything else the last iteration's."""
    for key, value in new.items():
        old = metrics.get(key)
        if isinstance(value, Max) and isinstance(old, Max):
            value = Max(max(old, value)) if old == old and value == value else Max(float("nan"))
        elif isinstance(value, Min) and isinstance(old, Min):
            value = Min(min(old, value)) if old == old and value == value else Min(float("nan"))
        metrics[key] = value


class _EmptyShare(AuxiliaryLoss):
    """A term another rank of a sharded policy's group has and this one does not: a forward and a
    backward of weight 0 on one padding token, so that this rank runs the same FSDP collectives."""

    def __init__(self, name: str, max_grad_share: float | None, grad_share_floor: float | None = None) -> None:
        self.name, self.max_grad_share, self.grad_share_floor = name, max_grad_share, grad_share_floor

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
    return list(terms) + [_EmptyShare(name, bound, floor) for name, bound, floor in batch.group_terms
                          if name not in mine]


def _grpo_backward(policy, batch, fabric, model, logprobs, slices, ref, sampler_weights, entropy: bool,
                   entropy_mask: Tensor | None = None, correction: SamplerCorrection | None = None) -> dict:
    """Step 1: the GRPO loss forward and backward per micro-batch; returns its metrics.

    Loss parts are divided by the group's totals, so they sum to the group's loss
    (:class:`~mrl_lightning.metrics.Sum`); the clip ratios, KL and entropy are means over
    this rank's counted tokens (:class:`~mrl_lightning.metrics.Mean` weighted by them).

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
    stats: dict[str, list[float]] = {}
    for sl in slices:
        logp, ent = logprobs(sl, model, entropy=entropy)
        old, weights = r.old_logprobs[sl], None if sampler_weights is None else sampler_weights[sl]
        if correction is not None:
            old, weights = correction.take(sl, logp)
        out = grpo_loss(
            logp, old, advantages[sl], mask[sl], **policy.loss_options(),
            ref_logp=None if ref is None else ref[sl], num_sequences=n_seq, num_tokens=n_tokens,
            sampler_weights=weights,
            entropy_mask=None if entropy_mask is None else entropy_mask[sl],
            sampling_logp=None if r.sampling_logprobs is None else r.sampling_logprobs[sl].to(logp.device),
        )
        fabric.backward(out.loss)
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
        note_loss_stats(stats, out, mask[sl], share)
    weight = float(mask.sum())
    if weight == 0:  # no counted token on this rank (dynamic sampling): nothing to average, no ratio seen
        return {f"train/{p}/loss": Sum(sums["loss"])}
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
    finish_loss_metrics(out_metrics, stats, f"train/{p}/", weight, issubclass(LOSS_TYPES[policy.loss_type], GRPO))
    return out_metrics


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
