"""A large tied output head's gradient from an auxiliary term, kept as its factors (docs/probes.md, "Cost").

The bound of :mod:`mrl_lightning.objectives.aux_share` needs each auxiliary term's gradient apart
from GRPO's. For a tied head of V x h weights (Gemma 3 270M: 262,144 x 640, 0.67 GB in float32)
that gradient, taken as autograd takes it, is three fresh ``[V, h]`` tensors per pass: the head's
weight gradient ``dZ^T H``, the embedding's dense lookup gradient (zeros plus the rows the pass
read), and their sum. On a CPU that is most of the pass for a few demo rows. While
:func:`collect` is active the pass makes none of them:

- the head (:class:`~mrl_lightning.model.logprobs._LinearHeadChunks`, which the log-probs then always
  take) keeps ``dZ`` (``[n, V]``, the logits' gradient at the n counted positions, in the compute
  dtype) and ``H`` (``[n, h]``) instead of returning ``dZ^T H``;
- the lookup returns its rows only (``torch.nn.Embedding(sparse=True)`` for the pass), so the
  weight's ``.grad`` is a sparse ``S``.

The term's gradient of the weight is ``G = S + dZ^T H``, and

    ||G||^2 = sum((dZ dZ^T) * (H H^T)) + 2 <S, dZ^T H> + ||S||^2

(the first term from two n x n Gram matrices, n a few hundred at most; the second over the rows
of S only), and ``total + s G`` is one ``addmm_`` into ``total`` plus one ``index_add_`` of S's
rows. Same values as the materialized gradient within float32 rounding (tested); under bf16
autocast within bf16's, where the materialized ``dZ^T H`` is rounded to bf16 and the factored sum,
in float32, is the closer of the two. Only on one rank (a group of several ranks reduces the
term's gradient before its norm, and the factors would have to be gathered instead), never for
FSDP or LoRA, only for float32 weights and only for a weight of more than
:data:`FACTORED_HEAD_ELEMENTS` entries: every model of the embedded default is far below it and
keeps the materialized gradient, bit for bit. A pass with more than
:data:`FACTOR_ELEMENTS` logit gradients (``n * V``) materializes the head's gradient as before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

FACTORED_HEAD_ELEMENTS = 1 << 24
"""Entries (V x h) above which a tied head's auxiliary gradient is kept as factors: 16,777,216.
SmolLM2-135M (49,152 x 576) and Gemma 3 270M (262,144 x 640) are above it."""

FACTOR_ELEMENTS = 1 << 26
"""The most logit-gradient entries (n positions x V) one pass keeps as factors: 67,108,864 (256 MiB
in float32; 256 positions of Gemma 3's vocabulary). Above it the head's gradient is materialized."""

_ACTIVE: list["HeadFactors"] = []


class HeadFactors:
    """The factors ``(dZ, H)`` of the head weight's gradient collected during one term's pass."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        self.weight = weight
        self.dz: list[Tensor] = []  # [n_i, V] each, compute dtype
        self.h: list[Tensor] = []  # [n_i, h] each, compute dtype
        self._stack: tuple[Tensor, Tensor] | None = None

    def keep(self, dz: Tensor, h: Tensor) -> None:
        """Keep one call's ``[n, V]`` logit gradient and ``[n, h]`` hidden states."""
        self.dz.append(dz.detach())
        self.h.append(h.detach())
        self._stack = None

    def clear(self) -> None:
        """Forget every factor (they were added into a materialized gradient)."""
        self.dz, self.h, self._stack = [], [], None

    def _stacked(self) -> tuple[Tensor, Tensor] | None:
        """All calls' ``(dZ, H)`` as two float32 tensors, stacked once for the norm and the sum."""
        if not self.dz:
            return None
        if self._stack is None:
            def whole(parts):
                return (parts[0] if len(parts) == 1 else torch.cat(parts)).float()

            self._stack = whole(self.dz), whole(self.h)
        return self._stack

    def norm_sq(self, rows: Tensor | None) -> float:
        """``||S + dZ^T H||^2`` (float64 sum) with ``S`` the weight's sparse ``.grad`` (None = 0)."""
        total = 0.0
        stacked = self._stacked()
        if rows is not None:
            rows = rows.coalesce()
            index, values = rows.indices()[0], rows.values().float()
            total += float(values.double().pow(2).sum())
            if stacked is not None:
                dz, h = stacked
                total += 2.0 * float((dz[:, index].t() @ h).double().mul(values.double()).sum())
        if stacked is not None:
            dz, h = stacked
            total += float(((dz @ dz.t()).double() * (h @ h.t()).double()).sum())
        return max(total, 0.0)

    def add_into(self, total: Tensor | None, rows: Tensor | None, scale: float) -> Tensor | None:
        """``total + scale * (S + dZ^T H)`` written into ``total`` (a zero tensor when it is None)."""
        stacked = self._stacked()
        if stacked is None and rows is None:
            return total
        if total is None:
            total = torch.zeros_like(self.weight)
        if scale == 0.0:
            return total
        if stacked is not None:
            dz, h = stacked
            total.addmm_(dz.t(), h, alpha=scale)
        if rows is not None:
            rows = rows.coalesce()
            total.index_add_(0, rows.indices()[0], rows.values().to(total.dtype), alpha=scale)
        return total


def factorable_weight(policy) -> torch.nn.Parameter | None:
    """The tied head weight of ``policy``'s model whose auxiliary gradient can be kept as factors, or None.

    A linear head without bias sharing its float32 weight with a ``torch.nn.Embedding``, trainable, of
    more than :data:`FACTORED_HEAD_ELEMENTS` entries, on a policy that is neither FSDP nor LoRA.
    """
    model = getattr(policy, "model", None)
    if model is None or getattr(policy, "fsdp", False) or getattr(policy, "is_adapter", False):
        return None
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding, head = (get_in() if get_in else None), (get_out() if get_out else None)
    if type(head) is not torch.nn.Linear or head.bias is not None or not isinstance(embedding, torch.nn.Embedding):
        return None
    weight = head.weight
    if weight is not embedding.weight or not weight.requires_grad or weight.numel() <= FACTORED_HEAD_ELEMENTS:
        return None
    if weight.dtype != torch.float32:  # the factors' sums are float32 (64-true, bf16-true: materialized)
        return None
    return weight


@contextlib.contextmanager
def collect(policy, factors: HeadFactors) -> Iterator[HeadFactors]:
    """While active: the head keeps its gradient's factors in ``factors`` and the lookup gives sparse rows
    (module docstring)."""
    embedding = policy.model.get_input_embeddings()
    sparse = embedding.sparse
    _ACTIVE.append(factors)
    embedding.sparse = True
    try:
        yield factors
    finally:
        embedding.sparse = sparse
        _ACTIVE.remove(factors)


def active_for(weight: Tensor) -> HeadFactors | None:
    """The collecting :class:`HeadFactors` of ``weight``, or None."""
    for factors in reversed(_ACTIVE):
        if factors.weight is weight:
            return factors
    return None
