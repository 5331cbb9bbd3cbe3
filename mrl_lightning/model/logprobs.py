"""Per-token log-probs and entropy of completions, the vocabulary taken in chunks (docs/speed.md, "Log-probs").

A completion's log-probs are gather minus logsumexp over the tempered logits of the
positions that predict it. The plain computation (:func:`token_logprobs`) takes the model's
``[N, L, V]`` logits whole: a float32 copy, its tempered copy, logsumexp's exponentials and,
in the backward, the logits' gradient, each ``[N, L, V]`` (2.1 GB each for N = 16, L = 32
and Gemma 3's V = 262,144). Above :data:`LOGPROB_CHUNK_ELEMENTS` logits a call takes the
chunked path instead (:func:`chunked_token_logprobs`): the model runs to its final hidden
states (``output_hidden_states``; its own head on one position per row only), and the
output head, softcapping, temperature, logsumexp, gather and entropy run per chunk of at
most ``LOGPROB_CHUNK_ELEMENTS // V`` counted positions, each chunk under activation
checkpointing (``torch.utils.checkpoint``, non-reentrant): the forward keeps only the chunk's
hidden states for the backward, which recomputes one chunk's logits at a time. The price is
one more head forward per update (the recomputation). Entropy is ``logz - sum(p * z)``
computed from the same chunk, without gradient, and not recomputed in the backward.

Exactness: below the threshold the plain computation runs unchanged, so the embedded
default (V of 300-400, a few hundred thousand logits a call) gets bit-identical log-probs
and gradients (tested). Above it the values agree with the plain computation within float
rounding (tested across chunk sizes: < 1e-5 nats, gradients within 1e-5 relative).

Two cases of the linear head's path: a call of at most one chunk of positions keeps that chunk's
logits for its backward instead of computing them again (one tile, the same product: the same
bits; tested); and while an auxiliary term's pass collects a large tied head's gradient as its
factors (:mod:`mrl_lightning.model.head_factors`), every call with gradient takes this path,
whatever its size, and its backward keeps ``dZ`` and ``H`` instead of making ``dZ^T H``.

The head is the model's own ``get_output_embeddings()`` module (a LoRA or
``modules_to_save`` wrapper included), run under the autocast state the model's forward ran
its head in (read by a pre-hook on the head), so mixed precision computes what the model's
own head computes. Every chunked call checks its head against the model's own logits at one
position; an architecture whose logits are not ``softcap(head(hidden))`` falls back to the
plain computation, with a warning once per model class.

Shapes: N rows, L completion length, H hidden width, V vocabulary.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mrl_lightning.model.forward import completion_hidden, completion_logits
from mrl_lightning.model.head_factors import FACTOR_ELEMENTS, active_for
from mrl_lightning.model.weight_casts import low

LOGPROB_CHUNK_ELEMENTS = 1 << 24
"""Logits (positions x V) one chunk of the chunked path holds: 16,777,216, 64 MiB in float32.

A call whose ``N * L * V`` is at most this takes the plain computation (one chunk of
``N * L`` positions, today's numbers); above it, chunks of ``LOGPROB_CHUNK_ELEMENTS // V``
counted positions (64 at V = 262,144; 341 at 49,152). At its peak (the backward of one
chunk) the chunked path holds about 4 float32 copies of one chunk's logits (docs/speed.md)."""

_WARNED: set[str] = set()
_CHECKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
"""Head modules whose model's logits matched ``softcap(head(hidden))`` once: later calls run the model's own
head on no position and skip the check (a pass over the whole head weight each, 0.1 s on Gemma 3's)."""

def token_logprobs(logits: Tensor, ids: Tensor, temperature: float, with_entropy: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
    """The plain computation over whole logits.

    Args:
        logits: ``[N, L, V]`` in the model's dtype, row t predicting ``ids[:, t]``.
        ids: ``[N, L]`` int64, the completion tokens.
        temperature: Sampling temperature (> 0): log-probs of ``softmax(logits / T)`` (TRL).
        with_entropy: Also return the entropy (a softmax over V, without gradient).

    Returns:
        ``([N, L] float32 nats, [N, L] float32 nats or None)``.
    """
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = torch.gather(logits, 2, ids.unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def _chunk(head, hidden: Tensor, ids: Tensor, temperature: float, softcap: float | None,
           with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropy) of ``[c]`` positions from their ``[c, H]`` hidden states."""
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, ids.unsqueeze(1)).squeeze(1) - logz
    entropy = None
    if with_entropy:  # after the last tensor the backward needs: checkpointing's recomputation stops before it
        with torch.no_grad():
            entropy = logz - torch.exp(logits - logz.unsqueeze(1)).mul_(logits).sum(-1)
    return logp, entropy


class _LinearHeadChunks(torch.autograd.Function):
    """Log-probs (and entropy) of ``[n]`` positions under a linear head, ``rows`` positions at a time.

    Forward: per chunk of ``rows`` positions, logits in the compute dtype (the autocast dtype the
    model's head ran in, else the weight's), softcap, float32, temperature, logsumexp, gather,
    entropy; it keeps the hidden states and each position's logsumexp. Backward: per tile of
    the vocabulary over every position (the same number of logits, ``rows * V``), the logits
    again, their gradient ``g * (onehot - p) / T`` (times the softcap's derivative) in place
    (``p`` from the kept logsumexp), the tile's rows of the weight gradient as one product over
    every position (as the whole-logits path computes each entry, no sum of chunk products)
    and the hidden states' gradient summed over the tiles in float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, softcap, rows, dtype, with_entropy):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        w, b = low(weight, dtype), None if bias is None else bias.to(dtype)
        logz = hidden.new_empty(n, dtype=torch.float32)
        logp = torch.empty_like(logz)
        entropy = torch.empty_like(logz) if with_entropy else None
        ctx.kept = None
        for s in range(0, n, rows):
            z, capped = _tempered(hidden[s: s + rows], w, b, softcap, temperature, dtype)
            if n <= rows and any(ctx.needs_input_grad[:3]):  # one chunk, so one tile of the backward: the same
                ctx.kept = (z, capped)  # product, kept instead of computed again (bits equal)
            lz = torch.logsumexp(z, dim=-1)
            logz[s: s + rows], logp[s: s + rows] = lz, z.gather(1, ids[s: s + rows].unsqueeze(1)).squeeze(1) - lz
            if entropy is not None:
                entropy[s: s + rows] = lz - torch.exp(z - lz.unsqueeze(1)).mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, ids, logz)
        ctx.settings = (temperature, softcap, rows, dtype)
        ctx.factors = active_for(weight) if bias is None else None  # an auxiliary term's pass (head_factors)
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, ids, logz = ctx.saved_tensors
        temperature, softcap, rows, dtype = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None:
            return (None,) * 9
        n, vocab = hidden.shape[0], weight.shape[0]
        tile = max(1, rows * vocab // max(n, 1))  # vocabulary entries a tile of all n positions holds
        h, g = hidden.to(dtype), grad_logp.float().unsqueeze(1)
        w, b = low(weight, dtype), None if bias is None else bias.to(dtype)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        factors = ctx.factors if need_w and n * vocab <= FACTOR_ELEMENTS else None
        grad_w = torch.empty_like(weight) if need_w and factors is None else None
        grad_b = torch.empty_like(bias) if need_b else None
        kept = []  # the factored weight gradient: dZ's tiles, in the compute dtype
        for v in range(0, vocab, tile):
            part = slice(v, v + tile)
            if ctx.kept is not None:  # n <= rows: this one tile is the whole vocabulary, as the forward's chunk
                (z, capped), ctx.kept = ctx.kept, None
            else:
                z, capped = _tempered(h, w[part], None if b is None else b[part], softcap, temperature, dtype)
            dz = z.sub_(logz.unsqueeze(1)).exp_().mul_(-g)  # -g p
            hit = ((ids >= v) & (ids < v + z.shape[1])).nonzero().squeeze(1)
            dz.index_put_((hit, ids[hit] - v), g[hit, 0], accumulate=True)  # + g onehot
            dz.div_(temperature)  # d / d(logits / T)
            if capped is not None:
                dz.mul_(1.0 - capped * capped)  # d softcap(x) / dx = 1 - tanh(x / cap)^2
            with torch.autocast(hidden.device.type, enabled=False):
                dz_low = dz.to(dtype)
                if grad_h is not None:  # summed over tiles in float32
                    grad_h.add_(torch.mm(dz_low, w[part]))
                if grad_w is not None:  # one product over every position per entry, as the whole-logits path
                    grad_w[part] = torch.mm(dz_low.t(), h)
                elif factors is not None:
                    kept.append(dz_low)
            if grad_b is not None:
                grad_b[part] = dz.sum(0)
        if factors is not None:  # dZ^T H stays factored: the bound takes its norm and sum from dZ and H
            factors.keep(torch.cat(kept, dim=1) if len(kept) > 1 else kept[0], h)
            ctx.factors = None  # the graph may outlive this backward: the factors then live in the bound only
        return (None if grad_h is None else grad_h.to(hidden.dtype), grad_w, grad_b,
                None, None, None, None, None, None)


def _tempered(hidden: Tensor, w: Tensor, b: Tensor | None, softcap: float | None, temperature: float,
              dtype) -> tuple[Tensor, Tensor | None]:
    """``(float32 softcap(hidden @ w.T + b) / T, tanh(logits / cap) or None)`` of one chunk, the product in ``dtype``."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = torch.mm(hidden.to(dtype), w.t())
        if b is not None:
            logits = logits + b
        capped = None
        if softcap is not None:
            capped = torch.tanh(logits.float() / softcap)
            logits = capped * softcap
        return logits.float() / temperature, capped


def chunked_token_logprobs(hidden: Tensor, head, ids: Tensor, mask: Tensor, temperature: float, *,
                           vocab: int, softcap: float | None = None, with_entropy: bool = False,
                           chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the counted positions, ``chunk_elements // vocab`` positions at a time.

    Args:
        hidden: ``[N, L, H]`` final hidden states, row t predicting ``ids[:, t]``.
        head: The output head module (``[*, H] -> [*, V]``).
        ids: ``[N, L]`` int64.
        mask: ``[N, L]`` bool, True = counted; other positions are not computed and get 0.
        temperature: > 0.
        vocab: V.
        softcap: ``final_logit_softcapping`` of the model (Gemma 2), applied before the temperature.
        with_entropy: Also return the entropy (no gradient).
        chunk_elements: Logits per chunk (:data:`LOGPROB_CHUNK_ELEMENTS`).

    Returns:
        ``([N, L] float32 nats, [N, L] float32 nats or None)``, 0 where not counted.
    """
    rows = max(1, chunk_elements // vocab)
    where = mask.reshape(-1).nonzero().squeeze(1)
    flat_h, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
    logps, entropies = [], []
    if type(head) is torch.nn.Linear and where.numel():  # the weights' gradient accumulated in place
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
        logp, entropy = _LinearHeadChunks.apply(flat_h[where], head.weight, head.bias, flat_ids[where],
                                                temperature, softcap, rows, dtype, with_entropy)
        logps, entropies = [logp], [entropy]
    else:  # any other head module (a LoRA or modules_to_save wrapper): each chunk under checkpointing
        recompute = torch.is_grad_enabled() and hidden.requires_grad
        for start in range(0, where.numel(), rows):
            at = where[start: start + rows]
            args = (head, flat_h[at], flat_ids[at], temperature, softcap, with_entropy)
            logp, entropy = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
            logps.append(logp)
            entropies.append(entropy)
    flat = hidden.new_zeros(flat_ids.shape, dtype=torch.float32)
    if logps:
        flat = flat.index_put((where,), torch.cat(logps))
    logp = flat.view(ids.shape)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(flat_ids.shape, dtype=torch.float32, device=ids.device)
        if entropies:
            entropy[where] = torch.cat(entropies)
        entropy = entropy.view(ids.shape)
    return logp, entropy


def _head_and_vocab(model) -> tuple[torch.nn.Module | None, int | None, float | None]:
    inner = getattr(model, "module", model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None, None, None
    weight = getattr(head, "weight", None)
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(head, "out_features", None) or (weight.shape[0] if isinstance(weight, Tensor) else None) \
        or getattr(text, "vocab_size", None)
    return head, vocab, getattr(text, "final_logit_softcapping", None)


class _SeenAutocast:
    """A pre-hook on the head that records the autocast state the model's forward runs it in.

    With ``skip`` (a checked linear head, asked for no position) the head's forward is replaced for
    the call by one that returns its empty output without touching the weight: run as it is, an
    empty product under autocast still casts the whole weight (Gemma 3's: 0.15 s, 0.34 GB).
    """

    def __init__(self, head, device_type: str, skip: bool = False) -> None:
        self.device_type, self.enabled, self.dtype = device_type, False, None
        self._handle = head.register_forward_pre_hook(self._record)
        self._head, self._own = head, head.__dict__.get("forward")
        if skip:
            real = head.forward

            def forward(x, *args, **kwargs):
                if x.shape[-2] != 0:  # a position after all: the head as it is
                    return real(x, *args, **kwargs)
                dtype = self.dtype if self.enabled else head.weight.dtype
                return x.new_empty((*x.shape[:-1], head.out_features), dtype=dtype)

            head.forward = forward

    def _record(self, module, args) -> None:
        self.enabled = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type)

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)

    def remove(self) -> None:
        self._handle.remove()
        if self._own is not None:
            self._head.forward = self._own
        else:
            self._head.__dict__.pop("forward", None)


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, *, temperature: float, share_prompts: bool = True,
                        with_entropy: bool = False, allow_chunks: bool = True,
                        chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropy) of completions under ``model`` (module docstring).

    Args:
        model: A causal LM (possibly Fabric-wrapped).
        prompt_ids: ``[N, P]`` int64, left-padded.
        prompt_mask: ``[N, P]`` bool, True = real token.
        completion_ids: ``[N, L]`` int64.
        completion_mask: ``[N, L]`` bool, True = counted.
        temperature: > 0.
        share_prompts: Run each distinct prompt once (:mod:`mrl_lightning.model.forward`).
        with_entropy: Also return the entropy.
        allow_chunks: False = always the plain computation (an FSDP policy, whose head is sharded
            outside its forward).
        chunk_elements: The threshold and chunk size (:data:`LOGPROB_CHUNK_ELEMENTS`).

    Returns:
        ``([N, L] float32 nats, [N, L] float32 nats or None)``; on the chunked path 0 where not counted.
    """
    head, vocab, softcap = _head_and_vocab(model) if allow_chunks else (None, None, None)
    n, length = completion_ids.shape
    name = type(getattr(model, "module", model)).__name__
    factored = head is not None and type(head) is torch.nn.Linear and torch.is_grad_enabled() \
        and active_for(head.weight) is not None and bool(completion_mask.any())  # a term's pass (head_factors)
    if head is None or vocab is None or (n * length * vocab <= chunk_elements and not factored) or name in _WARNED:
        logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts)
        return token_logprobs(logits, completion_ids, temperature, with_entropy)
    checked = head in _CHECKED and type(head) is torch.nn.Linear
    seen = _SeenAutocast(head, completion_ids.device.type, skip=checked)
    try:
        hidden, probe_hidden, probe_logits = completion_hidden(model, prompt_ids, prompt_mask, completion_ids,
                                                               completion_mask, share_prompts, probe=not checked)
    finally:
        seen.remove()
    with seen.context():
        if checked:
            return chunked_token_logprobs(hidden, head, completion_ids, completion_mask, temperature, vocab=vocab,
                                          softcap=softcap, with_entropy=with_entropy, chunk_elements=chunk_elements)
        with torch.no_grad():
            mine, theirs = head(probe_hidden[:1].detach()), probe_logits[:1].detach()
            if softcap is not None:
                mine = torch.tanh(mine / softcap) * softcap
        scale = 1.0 + float(theirs.float().abs().max())
        tolerance = (1e-4 if mine.dtype == torch.float32 and theirs.dtype == torch.float32 else 3e-2) * scale
        if mine.shape != theirs.shape or float((mine.float() - theirs.float()).abs().max()) > tolerance:
            _WARNED.add(name)
            warnings.warn(f"{name}: its logits are not softcap(output head(final hidden state)); log-probs are taken "
                          "over whole [N, L, V] logits for this model class (mrl_lightning.model.logprobs).", stacklevel=2)
            logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts)
            return token_logprobs(logits, completion_ids, temperature, with_entropy)
        _CHECKED.add(head)
        return chunked_token_logprobs(hidden, head, completion_ids, completion_mask, temperature, vocab=vocab,
                                      softcap=softcap, with_entropy=with_entropy, chunk_elements=chunk_elements)
