"""How much of a policy's update comes from each auxiliary loss, and a bound on it.

Probes add loss terms to a policy's GRPO loss (SGT's transfer term, PRP's peer term;
``docs/probes.md``). :func:`backward_aux_losses` backpropagates each term on its own, so
that its gradient ``g_k`` can be told apart from the GRPO gradient ``g_0`` (own samples,
KL included), and reports for each term

    grad_share_k = ||g_k|| / (||g_0|| + ||g_k||)                    (in [0, 1]; 0 when both are 0)

with ``||.||`` the L2 norm over all trainable parameters, before gradient clipping. A term
may carry a bound ``b`` (its ``max_grad_share`` attribute, in (0, 1)); a term whose share
exceeds it is scaled by

    s_k = b / (1 - b) * ||g_0|| / ||g_k||     so that   ||s_k g_k|| / (||g_0|| + ||s_k g_k||) = b

(and is dropped for the step when ``g_0`` is 0). The gradient the optimizer sees is
``g_0 + sum_k s_k g_k``. Each term is measured against the GRPO gradient alone, so the
bounds of several terms do not interact. Norms are this process's gradients before the
data-parallel all-reduce: exact with one rank per policy; with k ranks each rank measures
and bounds its own share (the metric is then the mean over ranks).
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
    parts = [g.detach().float().pow(2).sum() for g in grads if g is not None]
    return float(torch.stack(parts).sum().sqrt()) if parts else 0.0


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


def backward_aux_losses(aux_losses: list, policy, model, backward: Callable[[Tensor], None],
                        params: list[torch.nn.Parameter], tag: Callable[[str], str]) -> dict[str, float]:
    """Backpropagate each auxiliary term apart from the GRPO gradient already in ``.grad``.

    Args:
        aux_losses: Terms of :class:`~mrl_lightning.batch.AuxiliaryLoss` (``name``, called as
            ``term(policy, model) -> (loss, metrics)``; optional ``max_grad_share`` bound).
        policy: The policy, passed to each term.
        model: The (wrapped) model to run forward passes with, passed to each term.
        backward: ``fabric.backward``.
        params: The trainable parameters; their ``.grad`` holds the GRPO gradient on entry
            and ``g_0 + sum_k s_k g_k`` on return.
        tag: Term name -> the prefix of its metrics (e.g. ``probe/sgt/<policy>``).

    Returns:
        The terms' own metrics, plus per term name (terms of one name are summed):
        ``<prefix>/grad_share``, the share of the update, ``||s_k g_k|| / (||g_0|| + ||s_k g_k||)``
        (at most the bound); ``<prefix>/grad_share_raw``, the same before the bound (s_k = 1);
        ``<prefix>/grad_norm`` (``||g_k||``, unscaled); ``<prefix>/grad_scale`` (``s_k``); and
        ``<prefix>/grpo_grad_norm`` (``||g_0||``).

    Raises:
        ValueError: a term's ``max_grad_share`` is not in (0, 1).
    """
    main = _take_grads(params)
    main_norm = _norm(main)
    metrics: dict[str, float] = {}
    by_name: dict[str, list[list[Tensor | None]]] = {}
    bound: dict[str, float | None] = {}
    for aux in aux_losses:
        loss, aux_metrics = aux(policy, model)
        backward(loss)
        metrics.update(aux_metrics)
        by_name.setdefault(aux.name, []).append(_take_grads(params))
        bound.setdefault(aux.name, getattr(aux, "max_grad_share", None))
    total = list(main)
    for name, grads_list in by_name.items():
        grads = [None] * len(params)
        for one in grads_list:
            grads = [b if a is None else (a if b is None else a + b) for a, b in zip(grads, one)]
        norm = _norm(grads)
        raw, scale = share_scale(main_norm, norm, bound[name])
        bounded = scale * norm
        share = raw if scale == 1.0 else (bounded / (main_norm + bounded) if bounded > 0 else 0.0)
        prefix = tag(name)
        metrics.update({f"{prefix}/grad_share": share, f"{prefix}/grad_share_raw": raw, f"{prefix}/grad_norm": norm,
                        f"{prefix}/grad_scale": scale, f"{prefix}/grpo_grad_norm": main_norm})
        for i, g in enumerate(grads):
            if g is None or scale == 0.0:
                continue
            g = g if scale == 1.0 else g * scale
            total[i] = g if total[i] is None else total[i] + g
    for p, g in zip(params, total):
        p.grad = g
    return metrics
