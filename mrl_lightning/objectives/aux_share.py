"""How much of a policy's update comes from each auxiliary loss, and a bound on it.

Probes add loss terms to a policy's GRPO loss (SGT's transfer term, PRP's peer term;
``docs/probes.md``). :func:`backward_aux_losses` backpropagates each term on its own, so
that its gradient ``g_k`` can be told apart from the GRPO gradient ``g_0`` (own samples,
KL included), and reports for each term

    grad_share_k = ||g_k|| / (||g_0|| + ||g_k||)                    (in [0, 1]; 0 when both are 0)

with ``||.||`` the L2 norm over all trainable parameters, before gradient clipping. A term
may carry a bound ``b`` (its declared ``max_grad_share``, in (0, 1); None = no bound); a
term whose share exceeds it is scaled by

    s_k = b / (1 - b) * ||g_0|| / ||g_k||     so that   ||s_k g_k|| / (||g_0|| + ||s_k g_k||) = b

(and is dropped for the step when ``g_0`` is 0). The gradient the optimizer sees is
``g_0 + sum_k s_k g_k``. Each term is measured against the GRPO gradient alone, so the
bounds of several terms do not interact. Under data parallelism every gradient here is
the group's: the caller reduces ``g_0`` over the policy's ranks before the call, and each
term's ``g_k`` is reduced (``reduce``) before its norm is taken, so k ranks measure and
bound exactly what one rank on the whole batch would, and every rank applies the same scale.
A policy sharded with FSDP has its gradients reduced in the backward pass itself (``reduce``
None) and sharded: each norm is then taken over the whole mesh (:func:`_norm`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _take_grads(params: list[torch.nn.Parameter]) -> list[Tensor | None]:
    """The current ``.grad`` of every parameter, which is then cleared (set to None)."""
    out = [p.grad for p in params]
    for p in params:
        p.grad = None
    return out


def _norm(grads: list[Tensor | None]) -> float:
    """L2 norm over every tensor; a sharded gradient (FSDP's DTensor) counts whole (summed over its mesh)."""
    parts = [_whole(g.detach().float().pow(2).sum()) for g in grads if g is not None]
    return float(torch.stack(parts).sum().sqrt()) if parts else 0.0


def _whole(value: Tensor) -> Tensor:
    """A DTensor reduction's value over its whole mesh (a collective); any other tensor as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def share_scale(main_norm: float, term_norm: float, max_share: float | None) -> tuple[float, float]:
    """``(grad_share, scale)`` of one term against the GRPO gradient (module docstring).

    Args:
        main_norm: ``||g_0||``, L2 norm of the GRPO gradient (>= 0).
        term_norm: ``||g_k||``, L2 norm of the term's gradient (>= 0).
        max_share: Bound b in (0, 1), or None for no bound.

    Returns:
        The unbounded share ``||g_k|| / (||g_0|| + ||g_k||)`` (0 when both norms are 0) and the
        factor ``s_k`` in [0, 1] the term's gradient is multiplied by (1 when within the bound).

    Raises:
        ValueError: ``max_share`` not in (0, 1), or a negative norm.
    """
    if max_share is not None and not 0.0 < max_share < 1.0:
        raise ValueError(f"max_grad_share={max_share!r} must be in (0, 1) (a share of the update) or None for "
                         "no bound.")
    if main_norm < 0 or term_norm < 0:
        raise ValueError(f"gradient norms must be >= 0; got {main_norm} and {term_norm}.")
    total = main_norm + term_norm
    share = term_norm / total if total > 0 else 0.0
    if max_share is None or share <= max_share:
        return share, 1.0
    return share, max_share / (1.0 - max_share) * main_norm / term_norm


def term_names(aux_losses: list) -> list[tuple[str, float | None]]:
    """``(name, max_grad_share)`` of each term name, in order of first appearance (the first term's bound)."""
    names: dict[str, float | None] = {}
    for aux in aux_losses:
        names.setdefault(aux.name, aux.max_grad_share)
    return list(names.items())


def backward_aux_losses(aux_losses: list, policy, model, backward: Callable[[Tensor], None],
                        params: list[torch.nn.Parameter], tag: Callable[[str], str],
                        totals: dict[str, float] | None = None,
                        reduce: Callable[[list[torch.nn.Parameter]], None] | None = None,
                        terms: list[tuple[str, float | None]] | None = None) -> dict[str, float]:
    """Backpropagate each auxiliary term apart from the GRPO gradient already in ``.grad``.

    Args:
        aux_losses: Terms of :class:`~mrl_lightning.batch.AuxiliaryLoss` (``name``,
            ``max_grad_share``; called as ``term(policy, model, totals) -> (loss, metrics)``).
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
        terms: ``(name, max_grad_share)`` of every term name on any of the policy's ranks, in
            one order for all of them (``TrainBatch.group_terms``), so each rank reduces the
            same names in the same order, also a name it has no term of (its part is 0);
            None = this rank's names, in order of first appearance.

    Returns:
        The terms' own metrics, plus per term name (terms of one name are summed):
        ``<prefix>/grad_share``, the share of the update, ``||s_k g_k|| / (||g_0|| + ||s_k g_k||)``
        (at most the bound); ``<prefix>/grad_share_raw``, the same before the bound (s_k = 1);
        ``<prefix>/grad_norm`` (``||g_k||``, unscaled); ``<prefix>/grad_scale`` (``s_k``, also
        passed to each term's ``note_scale``); ``<prefix>/grpo_grad_norm`` (``||g_0||``); and
        ``<prefix>/share_measured`` (1: measured here; a fused step logs 0, :mod:`mrl_lightning.update`).

    Raises:
        ValueError: a term's ``max_grad_share`` is not in (0, 1).
    """
    main = _take_grads(params)
    main_norm = _norm(main)
    if terms is None:
        terms = term_names(aux_losses)
    metrics: dict[str, float] = {}
    total = list(main)
    for name, bound in terms:
        grads: list[Tensor | None] = [None] * len(params)
        for aux in aux_losses:
            if aux.name != name:
                continue
            loss, aux_metrics = aux(policy, model, dict(totals or {}))
            backward(loss)
            metrics.update(aux_metrics)
            grads = [b if a is None else (a if b is None else a + b) for a, b in zip(grads, _take_grads(params))]
        if reduce is not None:  # the group's gradient of this term, before its norm is taken
            for p, g in zip(params, grads):
                p.grad = g
            reduce(params)
            grads = _take_grads(params)
        norm = _norm(grads)
        raw, scale = share_scale(main_norm, norm, bound)
        bounded = scale * norm
        share = raw if scale == 1.0 else (bounded / (main_norm + bounded) if bounded > 0 else 0.0)
        prefix = tag(name)
        metrics.update({f"{prefix}/grad_share": share, f"{prefix}/grad_share_raw": raw, f"{prefix}/grad_norm": norm,
                        f"{prefix}/grad_scale": scale, f"{prefix}/grpo_grad_norm": main_norm,
                        f"{prefix}/share_measured": 1.0})
        for aux in aux_losses:
            if aux.name == name and hasattr(aux, "note_scale"):
                aux.note_scale(scale)
        for i, g in enumerate(grads):
            if g is None or scale == 0.0:
                continue
            g = g if scale == 1.0 else g * scale
            total[i] = g if total[i] is None else total[i] + g
    for p, g in zip(params, total):
        p.grad = g
    return metrics
