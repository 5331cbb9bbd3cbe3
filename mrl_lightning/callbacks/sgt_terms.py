"""SGT's loss terms and the packed prompt-id sets of its checkpoint (docs/probes.md).

:class:`_SGTTransferLoss` (``transfer_mode: nll``) and :class:`_SGTGroupLoss` (``group``) are
the :class:`~mrl_lightning.update.batch.AuxiliaryLoss` terms :class:`~mrl_lightning.callbacks.SuccessGatedTransfer`
appends to a receiver's batch; :func:`pack_ids` / :func:`unpack_ids` store its sets of prompt ids.
"""

from __future__ import annotations

import zlib

import torch

from mrl_lightning.update.batch import AuxiliaryLoss
from mrl_lightning.metrics import Mean
from mrl_lightning.probes.sgt import pad_demos, sgt_group_loss, sgt_loss


def pack_ids(ids) -> bytes:
    """A set of prompt ids as ``zlib`` of their sorted, newline-joined text (weights-only loadable, exact).

    Raises:
        ValueError: an id holds a newline (it could not be told apart on unpacking).
    """
    ids = sorted(ids)
    if any("\n" in i for i in ids):
        raise ValueError(f"pack_ids: prompt id {next(i for i in ids if chr(10) in i)!r} holds a newline.")
    return zlib.compress("\n".join(ids).encode("utf-8"), 9)


def unpack_ids(packed) -> set[str]:
    """Inverse of :func:`pack_ids`; a list of ids (the format before packing) is read as it is."""
    if isinstance(packed, (bytes, bytearray)):
        text = zlib.decompress(packed).decode("utf-8")
        return set(text.split("\n")) if text else set()
    return set(packed)


def _demo_nll(logp: torch.Tensor, c_mask: torch.Tensor) -> Mean:
    """Mean NLL per demo token (nats) of ``[D, Lc]`` log-probs under the ``[D, Lc]`` mask."""
    return Mean(float(-(logp.detach() * c_mask).sum() / c_mask.sum().clamp(min=1)), float(c_mask.sum()))


class _DemoTerm(AuxiliaryLoss):
    """An SGT term over the receiver's demos: a forward and backward of its own over the demo rows only
    (the step's few transferred successes, not the GRPO batch), so that its gradient, and with it the
    share bound, is exact on every step (docs/probes.md, "Cost")."""

    name = "sgt"

    def __init__(self, demos, tag: str, max_grad_share: float | None, pad_id: int,
                 grad_share_floor: float | None = None) -> None:
        self.demos, self.tag, self.max_grad_share, self.pad_id = demos, tag, max_grad_share, pad_id
        self.grad_share_floor = grad_share_floor

    def __call__(self, policy, model, totals: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        p_ids, p_mask, c_ids, c_mask = pad_demos(self.demos, self.pad_id)
        device = next(policy.model.parameters()).device
        logp, _ = policy.completion_logprobs(p_ids.to(device), p_mask.to(device), c_ids.to(device),
                                             c_mask.to(device), model=model)
        return self.loss_from_logprobs(policy, logp, c_mask.to(device), totals)

    def pass_shape(self) -> tuple[int, int]:
        """``(demos, longest prompt + longest completion)``: the padded rows of its pass."""
        return len(self.demos), max((len(p) for p, _ in self.demos), default=0) + \
            max((len(c) for _, c in self.demos), default=0)

    def loss_from_logprobs(self, policy, logp: torch.Tensor, completion_mask: torch.Tensor,
                           totals: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
        """The term's loss from the demos' ``[M, L]`` float32 log-probs (nats) under their ``[M, L]`` bool mask."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss_from_logprobs")


class _SGTTransferLoss(_DemoTerm):
    """``transfer_mode: nll``: ``lambda * A_plus * mean NLL`` over the demos of every rank (:func:`sgt_loss`)."""

    def __init__(self, demos, lambda_sgt: float, advantage_plus: float, tag: str,
                 max_grad_share: float | None, pad_id: int, grad_share_floor: float | None = None) -> None:
        super().__init__(demos, tag, max_grad_share, pad_id, grad_share_floor)
        self.lambda_sgt, self.advantage_plus = lambda_sgt, advantage_plus

    def loss_from_logprobs(self, policy, logp, completion_mask, totals):
        loss = sgt_loss(logp, completion_mask, self.lambda_sgt, self.advantage_plus,
                        num_demos=float(totals.get("sgt_demos", 0.0)) or None)
        return loss, {f"{self.tag}/nll_nats": _demo_nll(logp, completion_mask)}


class _SGTGroupLoss(_DemoTerm):
    """``transfer_mode: group``: the demos as extra GRPO samples (:func:`sgt_group_loss`)."""

    def __init__(self, demos, advantages: torch.Tensor, lambda_sgt: float, tag: str,
                 max_grad_share: float | None, pad_id: int, grad_share_floor: float | None = None) -> None:
        super().__init__(demos, tag, max_grad_share, pad_id, grad_share_floor)
        self.advantages, self.lambda_sgt = advantages, lambda_sgt

    def loss_from_logprobs(self, policy, logp, completion_mask, totals):
        # the normalizers of own samples + demos, summed over the policy's ranks
        loss = sgt_group_loss(logp, completion_mask, self.advantages.to(completion_mask.device), self.lambda_sgt,
                              policy.loss_type, num_sequences=float(totals.get("sequences", 0.0)),
                              num_tokens=float(totals.get("tokens", 0.0)),
                              max_completion_length=policy.max_completion_length)
        return loss, {f"{self.tag}/nll_nats": _demo_nll(logp, completion_mask)}
