"""One cast of each weight per optimizer step under mixed precision (docs/speed.md, "Casts").

Under mixed precision (bf16 / fp16 autocast) every forward pass casts each float32 weight it
uses to the compute dtype, and autocast forgets its casts when its outermost region ends: one
cast of every weight per pass. An update runs several passes on weights that do not change
until its optimizer step: the GRPO micro-batches, then each auxiliary term's own pass (SGT's
demos, docs/probes.md, "Cost"). While :func:`shared_casts` is active they share one cast of each
weight:

- every weight autocast casts (the linear layers') through autocast's own cache, which the
  context keeps alive across the passes' regions by holding an autocast region that is itself
  disabled (nothing outside the passes' own regions runs under autocast);
- the chunked output head (:mod:`mrl_lightning.model.logprobs`), which casts its weight explicitly, in
  its forward and again in its backward (Gemma 3 270M: 0.67 GB read, 0.34 GB written, 0.15 s on a
  CPU core each), through the context's own cache (:func:`low`): one cast per (weight, dtype),
  kept while the weight is unchanged (its version counter).

The same values as fresh casts: bits unchanged (tested). The update
(:func:`mrl_lightning.update.policy_update.policy_update`) opens the context around each optimizer step's
passes and closes it before the step, so no cast outlives the weights it was made from: the
weights must not change inside it (autocast's cache does not look at a weight's version, and a
write through ``.data`` passes the head's check unseen). A head cast by the model's own forward
(a call small enough for whole logits) and by the chunked path in one context is held twice.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

_SCOPES: list[dict] = []  # the active contexts' caches: key -> (weight version, cast)


def low(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` in ``dtype``, without gradient (the chunked head's product), made once per active context.

    Outside a context, or for a weight already in ``dtype``, a plain ``.to``.
    """
    if not _SCOPES or weight.dtype == dtype:
        return weight.detach().to(dtype)
    key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
           dtype)
    hit = _SCOPES[-1].get(key)
    if hit is not None and hit[0] == weight._version:
        return hit[1]
    cast = weight.detach().to(dtype)
    _SCOPES[-1][key] = (weight._version, cast)
    return cast


@contextlib.contextmanager
def shared_casts(device_type: str | None = None) -> Iterator[None]:
    """While active, the passes share one cast of each weight (module docstring).

    Args:
        device_type: The weights' device type (``cpu``, ``cuda``) whose autocast cache to keep
            alive across the passes' regions; None = the head's casts only (an FSDP policy, whose
            weights are gathered for each pass).
    """
    _SCOPES.append({})
    try:
        with torch.autocast(device_type, enabled=False) if device_type else contextlib.nullcontext():
            yield
    finally:
        _SCOPES.pop()
