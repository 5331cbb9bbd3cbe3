"""THL residual: what the cross-tokenizer mapping could not keep exact (docs/thl.md).

Computed for every shared batch and logged under ``thl/`` (docs/README.md, tag prefixes). Definitions:

- ``round_trip_failures`` (count): sequences whose source ids or receiver ids do not
  spell the completion text byte for byte (decode(encode(x)) != x).
- ``boundary_agreement`` (share in [0, 1]): interior target token boundaries that are
  also source boundaries, pooled over the batch (1.0 when there are none).
- ``tokens_per_chunk``: (source tokens + target tokens) / (2 * chunks holding a token);
  1.0 iff the two segmentations are identical. ``source_tokens_per_chunk`` / ``target_tokens_per_chunk``
  give each side.
- ``logprob_mass_moved`` (share in [0, 1]): of the total absolute source log-prob mass,
  the part in chunks whose mass had to be split over two or more target tokens (the
  documented in-chunk approximation). ``logprob_mass_moved_nats`` is that mass per
  sequence, in nats.
- ``max_conservation_error`` (nats): max over sequences of ``|sum(mapped) - sum(source)|``.
- ``retokenize_fallbacks``: sequences the receiver's own encoder could not reproduce
  (greedy byte-string encoding used); ``invalid_utf8_tails``: completions cut inside a
  character; ``num_sequences``.
"""

from __future__ import annotations

from typing import Sequence

from mrl_lightning.metrics import Max, Ratio, Sum
from mrl_lightning.thl.trace import MappedTrace


def moved_mass(trace: MappedTrace) -> tuple[float, float]:
    """(absolute source log-prob mass split inside chunks, total absolute mass), nats.

    A chunk's mass counts as moved when it is spread over two or more target tokens
    (with bytes, or any target tokens in a mismatch chunk).
    """
    al = trace.alignment
    _, tgt_sizes = al.chunk_sizes()
    with_bytes = [0] * al.num_chunks
    for k, n in zip(al.target_chunk, al.target_lengths):
        with_bytes[k] += n > 0
    last = al.num_chunks - 1
    moved = total = 0.0
    for k, lp in zip(al.source_chunk, trace.source_logprobs):
        total += abs(lp)
        if with_bytes[k] >= 2 or (not al.bytes_match and k == last and tgt_sizes[k] >= 2):
            moved += abs(lp)
    return moved, total


def residual_metrics(traces: Sequence[MappedTrace], prefix: str = "thl/") -> dict[str, float]:
    """Residual metrics of one shared batch (docs/thl.md).

    Args:
        traces: The batch's mapped peer completions (:func:`.transfer_trace` results).
        prefix: Prepended to every key (``"thl/"`` for the logger, ``""`` for the CLI).

    Returns:
        ``{prefix + name: value}`` with the names in the module doc, all floats; only
        ``num_sequences`` (0.0) for an empty batch.
    """
    if not traces:
        return {f"{prefix}num_sequences": Sum(0.0)}
    failures = fallbacks = tails = 0
    agreed = interior = 0
    n_src = n_tgt = n_chunks = 0
    moved = total = 0.0
    max_err = 0.0
    for tr in traces:
        failures += not tr.round_trip_ok
        fallbacks += tr.retokenized.used_fallback
        tails += tr.retokenized.invalid_utf8_tail
        a, b = tr.alignment.boundary_counts()
        agreed, interior = agreed + a, interior + b
        n_src += len(tr.alignment.source_lengths)
        n_tgt += len(tr.alignment.target_lengths)
        src_sizes, tgt_sizes = tr.alignment.chunk_sizes()
        n_chunks += sum(1 for a_k, b_k in zip(src_sizes, tgt_sizes) if a_k or b_k)
        m, t = moved_mass(tr)
        moved, total = moved + m, total + t
        max_err = max(max_err, tr.conservation_error)
    n = len(traces)
    metrics = {  # each says how it pools over ranks (mrl_lightning.metrics): counts, shares of counts, a max
        "num_sequences": Sum(n),
        "round_trip_failures": Sum(failures),
        "boundary_agreement": Ratio(agreed, interior, empty=1.0),
        "tokens_per_chunk": Ratio(n_src + n_tgt, 2 * n_chunks, empty=1.0),
        "source_tokens_per_chunk": Ratio(n_src, n_chunks, empty=1.0),
        "target_tokens_per_chunk": Ratio(n_tgt, n_chunks, empty=1.0),
        "logprob_mass_moved": Ratio(moved, total),
        "logprob_mass_moved_nats": Ratio(moved, n),
        "max_conservation_error": Max(max_err),
        "retokenize_fallbacks": Sum(fallbacks),
        "invalid_utf8_tails": Sum(tails),
    }
    return {prefix + k: v for k, v in metrics.items()}
