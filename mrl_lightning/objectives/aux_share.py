"""How much of a policy's update comes from each auxiliary loss, and a bound on it.

Probes add loss terms to a policy's GRPO loss (SGT's transfer term, PRP's peer term;
``docs/probes.md``). :func:`backward_aux_losses` backpropagates each term on its own, so
that its gradient ``g_k`` can be told apart from the GRPO gradient ``g_0`` (own samples,
KL included), and reports for each term

    grad_share_k = ||g_k|| / (||g_0|| + ||g_k||)                    (in [0, 1]; 0 when both are 0)

with ``||.||`` the L2 norm over all trainable parameters, before gradient clipping. A term
may carry a bound ``b`` (its declared ``max_grad_share``, in (0, 1); None = no bound); a
term whose share exceeds it is scaled by

    s_k = b / (1 - b) * r / ||g_k||     so that   ||s_k g_k|| / (r + ||s_k g_k||) = b

where ``r`` is the reference norm: ``||g_0||`` itself (strict: the share of the applied
update is at most ``b`` on every step, and a step whose GRPO gradient is 0 gets no
transfer), or ``max(||g_0||, f)`` when the term declares a floor ``f``
(``grad_share_floor``, in gradient-norm units): a step whose GRPO gradient is below the
floor (every group's rewards tied, the regime rescue is for) still lets the term move the
policy by up to ``b / (1 - b) * f``, and its share of the applied update is then above
``b`` (logged as it is). The gradient the optimizer sees is ``g_0 + sum_k s_k g_k``, and
every share logged is computed from those scaled parts, so it is the share of the update
actually applied (clipping scales both parts alike and leaves it unchanged). A NaN or inf in
either gradient is not bounded away: the term is added whole (shares logged NaN), and the
update's non-finite check skips the step (``mrl_lightning/model/numerics.py``). Each term is
measured against the GRPO gradient alone, so the bounds of several terms do not interact.

Under data parallelism every gradient here is the group's: the caller reduces ``g_0`` over
the policy's ranks before the call, and each term's ``g_k`` is reduced (``reduce``) before
its norm is taken, so k ranks measure and bound exactly what one rank on the whole batch
would, and every rank applies the same scale. A policy sharded with FSDP has its gradients
reduced in the backward pass itself (``reduce`` None) and sharded: each norm is then taken
over the whole mesh (:func:`_norm`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import Tensor

from mrl_lightning.metrics import Max, Min
from mrl_lightning.model.head_factors import HeadFactors, collect


def _take_grads(params: list[torch.nn.Parameter]) -> list[Tensor | None]:
    """The current ``.grad`` of every parameter, which is then cleared (set to None)."""
    out = [p.grad for p in params]
    for p in params:
        p.grad = None
    return out


def _norm(grads: list[Tensor | None]) -> float:
    """L2 norm over every tensor; a sharded gradient (FSDP's DTensor) counts whole (summed over its mesh).

    Summed in float32; when that overflows (entries above ~1.8e19) while every entry is finite, again in
    float64, so a finite but huge gradient gets a finite norm (and is bounded, not silently dropped as a
    norm of inf would make it); only a NaN or inf entry gives NaN or inf.
    """
    present = [g.detach() for g in grads if g is not None]
    if not present:
        return 0.0
    norm = float(torch.stack([_squares(g, torch.float32) for g in present]).sum().sqrt())
    if norm == float("inf") and all(bool(torch.isfinite(_whole(g.abs().amax()))) for g in present):
        norm = float(sum(float(_squares(g, torch.float64)) for g in present) ** 0.5)
    return norm


NORM_CHUNK_ELEMENTS = 1 << 18
"""Entries one chunk holds where :func:`_squares` converts a large tensor on the way (a bf16 gradient to
float32 sums, or float32 to the float64 of :func:`_norm`'s overflow fallback): 262,144, so that the
converted copy is one chunk (1 MiB in float32) that stays in cache, not a copy of the whole gradient."""

WHOLE_SUM_ELEMENTS = 1 << 17
"""Entries at or below which :func:`_squares` squares a tensor and sums it whole, and :func:`_scaled_sum`
scales then adds: 131,072. Every tensor of the embedded default's models (at most 65,536 entries), whose
norms and sums are therefore what they always were. A larger one (a real model's layers, Gemma 3 270M's
167.8 M-entry embedding) is summed by rows without a temporary of its size (:data:`NORM_ROW`) and scaled
into its sum in one pass (docs/probes.md, "Cost")."""

NORM_ROW = 256
"""Entries per row of a large tensor's sum of squares: each row's norm in float32 (one
``torch.linalg.vector_norm`` over the tensor viewed as rows: the speed of one read), the rows' squares
summed in float64. Relative error about 2e-8 on 2^27 normal entries, where a float32 dot product of the
tensor with itself was off by 1.3e-3, and squaring then summing (2e-8) was 1.5x slower and made a
temporary the size of the tensor."""


def _squares(g: Tensor, dtype: torch.dtype) -> Tensor:
    """Sum of squares of ``g``'s entries (any float dtype) as a 0-d ``dtype`` tensor; no temporary the size of a
    large ``g`` (a float64 one, a 64-true run's, in float32 chunks as before)."""
    if hasattr(g, "full_tensor") or g.numel() <= WHOLE_SUM_ELEMENTS or not g.is_contiguous() or g.is_sparse:
        return _whole(g.to(dtype).pow(2).sum())  # a sharded DTensor: summed over its mesh by _whole
    flat = g.view(-1)
    if dtype != torch.float32 or g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return torch.stack([chunk.to(dtype).pow(2).sum() for chunk in flat.split(NORM_CHUNK_ELEMENTS)]).sum()
    whole = flat.numel() // NORM_ROW * NORM_ROW
    rows = flat[:whole].view(-1, NORM_ROW)
    if g.dtype == torch.float32:
        norms = torch.linalg.vector_norm(rows, dim=1)
    else:  # converted chunk by chunk inside the norm: each chunk's float32 copy stays in cache
        step = NORM_CHUNK_ELEMENTS // NORM_ROW
        norms = torch.cat([torch.linalg.vector_norm(rows[i: i + step], dim=1, dtype=torch.float32)
                           for i in range(0, rows.shape[0], step)])
    total = norms.double().pow(2).sum()
    if whole < flat.numel():
        total = total + flat[whole:].double().pow(2).sum()
    return total.float()


def _scaled_sum(total: Tensor | None, g: Tensor, scale: float) -> Tensor:
    """``total + g * scale`` written into ``total`` (``g`` itself when ``total`` is None; ``g`` may be overwritten).

    At or below :data:`WHOLE_SUM_ELEMENTS` entries (every tensor of the embedded default's models), with
    the rounding of ``g * scale`` then ``+`` (no fused multiply-add), as it always was; a larger
    dense tensor in one pass, ``total.add_(g, alpha=scale)`` (2.2x faster than scaling then adding on
    a CPU core for SmolLM2-135M's layers; each entry within one rounding of the two-step sum).
    """
    if total is None or hasattr(g, "full_tensor") or not (g.is_contiguous() and total.is_contiguous()) \
            or g.shape != total.shape or g.numel() <= WHOLE_SUM_ELEMENTS or g.is_sparse or total.is_sparse \
            or g.untyped_storage().data_ptr() == total.untyped_storage().data_ptr():  # shared memory: as before
        if scale != 1.0:
            g.mul_(scale)  # the same rounding as g * scale
        return g if total is None else total.add_(g)
    return total.add_(g, alpha=scale)


def _plus(a: Tensor, b: Tensor) -> Tensor:
    """``a + b``; ``b + a`` when only ``a`` is sparse (a factored head's rows, then a materialized pass)."""
    return b + a if a.is_sparse and not b.is_sparse else a + b


def _whole(value: Tensor) -> Tensor:
    """A DTensor reduction's value over its whole mesh (a collective); any other tensor as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def share_scale(main_norm: float, term_norm: float, max_share: float | None,
                floor: float | None = None) -> tuple[float, float]:
    """``(grad_share, scale)`` of one term against the GRPO gradient (module docstring).

    Args:
        main_norm: ``||g_0||``, L2 norm of the GRPO gradient (>= 0).
        term_norm: ``||g_k||``, L2 norm of the term's gradient (>= 0).
        max_share: Bound b in (0, 1), or None for no bound.
        floor: ``f`` >= 0, the least reference norm (``grad_share_floor``); None = 0 (strict).

    Returns:
        The unbounded share ``||g_k|| / (||g_0|| + ||g_k||)`` (0 when both norms are 0) and the
        factor ``s_k`` in [0, 1] the term's gradient is multiplied by (1 when within the bound,
        ``b / (1 - b) * max(||g_0||, f) / ||g_k||`` otherwise). A NaN or inf norm gives ``(nan, 1)``:
        such a gradient is not scaled to 0 and dropped unseen, it reaches the update's non-finite
        check, which skips the step and counts it (``mrl_lightning/model/numerics.py``).

    Raises:
        ValueError: ``max_share`` not in (0, 1), a negative norm or a negative floor.
    """
    if max_share is not None and not 0.0 < max_share < 1.0:
        raise ValueError(f"max_grad_share={max_share!r} must be in (0, 1) (a share of the update) or None for "
                         "no bound.")
    if main_norm < 0 or term_norm < 0:
        raise ValueError(f"gradient norms must be >= 0; got {main_norm} and {term_norm}.")
    if floor is not None and not floor >= 0:
        raise ValueError(f"grad_share_floor={floor!r} must be >= 0 (a gradient norm) or None for none.")
    if not (math.isfinite(main_norm) and math.isfinite(term_norm)):  # NaN or inf: left whole for the update's check
        return float("nan"), 1.0
    total = main_norm + term_norm
    share = term_norm / total if total > 0 else 0.0
    reference = max(main_norm, floor or 0.0)
    if max_share is None or term_norm == 0.0 or term_norm / (reference + term_norm) <= max_share:
        return share, 1.0
    return share, max_share / (1.0 - max_share) * reference / term_norm


def term_names(aux_losses: list) -> list[tuple[str, float | None, float | None]]:
    """``(name, max_grad_share, grad_share_floor)`` of each term name, in order of first appearance
    (the first term's bound and floor)."""
    names: dict[str, tuple[float | None, float | None]] = {}
    for aux in aux_losses:
        names.setdefault(aux.name, (aux.max_grad_share, getattr(aux, "grad_share_floor", None)))
    return [(name, bound, floor) for name, (bound, floor) in names.items()]


def backward_aux_losses(aux_losses: list, policy, model, backward: Callable[[Tensor], None],
                        params: list[torch.nn.Parameter], tag: Callable[[str], str],
                        totals: dict[str, float] | None = None,
                        reduce: Callable[[list[torch.nn.Parameter]], None] | None = None,
                        terms: list[tuple[str, float | None, float | None]] | None = None,
                        factored_head: torch.nn.Parameter | None = None) -> dict[str, float]:
    """Backpropagate each auxiliary term apart from the GRPO gradient already in ``.grad``.

    Args:
        aux_losses: Terms of :class:`~mrl_lightning.update.batch.AuxiliaryLoss` (``name``,
            ``max_grad_share``, optional ``grad_share_floor``; called as
            ``term(policy, model, totals) -> (loss, metrics)``).
        policy: The policy, passed to each term.
        model: The (wrapped) model to run forward passes with, passed to each term.
        backward: ``fabric.backward``.
        params: The trainable parameters; their ``.grad`` holds the (group-reduced) GRPO
            gradient on entry and ``g_0 + sum_k s_k g_k`` on return.
        tag: Term name -> the prefix of its metrics (e.g. ``probe/sgt/<policy>``).
        totals: The batch's loss normalizers summed over the policy's ranks
            (``TrainBatch.group_counts``), passed to each term; None = ``{}``.
        reduce: Sums ``.grad`` of ``params`` over the policy's ranks in place, called once per
            term name (after that name's terms are backpropagated); None = one rank.
        terms: ``(name, max_grad_share, grad_share_floor)`` of every term name on any of the
            policy's ranks, in one order for all of them (``TrainBatch.group_terms``), so each
            rank reduces the same names in the same order, also a name it has no term of (its
            part is 0); None = this rank's names, in order of first appearance (:func:`term_names`).
        factored_head: A tied head weight in ``params`` whose term gradients are kept as their factors
            during each term's pass (:mod:`mrl_lightning.model.head_factors`; the caller passes it
            only for a policy on one rank, ``reduce`` then has nothing to sum); None = materialized.

    Returns:
        The terms' own metrics, plus per term name (terms of one name are summed):
        ``<prefix>/grad_share``, the term's share of the update applied,
        ``||s_k g_k|| / (||g_0|| + ||s_k g_k||)`` (at most the bound unless a floor lifted the
        reference); ``<prefix>/grad_share_max``, the same, combined over a log window by its
        maximum; ``<prefix>/grad_share_raw``, the share before the bound (s_k = 1);
        ``<prefix>/grad_norm`` (``||g_k||``, unscaled); ``<prefix>/grad_scale`` (``s_k``);
        ``<prefix>/grpo_grad_norm`` (``||g_0||``), ``<prefix>/grpo_grad_norm_min`` (the same,
        combined over a log window by its minimum: 0 shows a step whose transfer the strict
        bound dropped); and, for a term with a floor,
        ``<prefix>/grad_share_floor_active`` (1 when ``||g_0||`` was below the floor).

    Raises:
        ValueError: a term's ``max_grad_share`` is not in (0, 1), or its floor is negative.
    """
    main = _take_grads(params)
    main_norm = _norm(main)
    if terms is None:
        terms = term_names(aux_losses)
    metrics: dict[str, float] = {}
    total = list(main)
    at = next((i for i, p in enumerate(params) if p is factored_head), None) if factored_head is not None else None
    for name, bound, floor in terms:
        grads: list[Tensor | None] = [None] * len(params)
        factors = HeadFactors(factored_head) if at is not None else None
        for aux in aux_losses:
            if aux.name != name:
                continue
            with collect(policy, factors) if factors is not None else contextlib.nullcontext():
                loss, aux_metrics = aux(policy, model, dict(totals or {}))
                backward(loss)
                del loss  # its graph, and what the graph holds, before the next term's forward
            metrics.update(aux_metrics)
            grads = [b if a is None else (a if b is None else _plus(a, b)) for a, b in zip(grads, _take_grads(params))]
        if reduce is not None:  # the group's gradient of this term, before its norm is taken
            for p, g in zip(params, grads):
                p.grad = g
            reduce(params)
            grads = _take_grads(params)
        if at is not None and grads[at] is not None and not grads[at].is_sparse:
            grads[at] = factors.add_into(grads[at], None, 1.0)  # a pass materialized it: the factors join it
            factors.clear()
        factored = at is not None and (factors.dz or (grads[at] is not None and grads[at].is_sparse))
        if not factored:
            norm = _norm(grads)
        else:  # the tied head's part from its factors and sparse rows (head_factors)
            rest = _norm([g if i != at else None for i, g in enumerate(grads)])
            norm = (rest * rest + factors.norm_sq(grads[at])) ** 0.5
        raw, scale = share_scale(main_norm, norm, bound, floor)
        bounded = scale * norm
        share = bounded / (main_norm + bounded) if bounded > 0 else (0.0 if bounded == 0 else float("nan"))
        prefix = tag(name)
        metrics.update({f"{prefix}/grad_share": share, f"{prefix}/grad_share_max": Max(share),
                        f"{prefix}/grad_share_raw": raw, f"{prefix}/grad_norm": norm,
                        f"{prefix}/grad_scale": scale, f"{prefix}/grpo_grad_norm": main_norm,
                        f"{prefix}/grpo_grad_norm_min": Min(main_norm)})
        if floor is not None:
            metrics[f"{prefix}/grad_share_floor_active"] = float(main_norm < floor)
        for i, g in enumerate(grads):  # in place: no third set for the sum (docs/mwra.md, "aux. backward")
            grads[i] = None
            if i == at and factored:  # scale (S + dZ^T H) into GRPO's
                total[i] = factors.add_into(total[i], g, scale) if scale != 0.0 or total[i] is not None else None
                continue
            if g is None or scale == 0.0:
                continue
            total[i] = _scaled_sum(total[i], g, scale)
        del grads
    for p, g in zip(params, total):
        p.grad = g
    return metrics
