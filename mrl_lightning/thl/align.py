"""Align two segmentations of one text on shared byte boundaries (docs/thl.md).

Both sides are given as the bytes (or byte spans) of their tokens, in order. A
*boundary* of a side is a byte position where one of its tokens ends. *Chunks* are
the maximal byte spans whose two ends are boundaries of both sides, so every chunk
boundary is a token boundary on both sides and every token with bytes lies inside
exactly one chunk (docs/thl.md, "Alignment").

Tokens without bytes (EOS, other specials) belong to the chunk that ends at their
position (the first chunk at position 0).

If the two byte strings differ (a text that did not round-trip, or a cut character
decoded to ``"\\ufffd"`` on one side only), chunks are built on their longest common
prefix and everything after the last shared boundary inside it forms one final
*mismatch chunk*. Sums over chunks stay exact; only the in-chunk split changes
(see :mod:`.trace`).

Precomputed for the trace mapping: parallel lists of (target token, source token,
weight, overlap) pairs, where ``weight`` is the share of the source token's mass the
target token receives (weights of one source token sum to 1 when its chunk has target
tokens) and ``overlap`` the bytes they share (for intensive quantities).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence


@dataclass(frozen=True)
class Alignment:
    """A chunking of a source and a target segmentation of one byte string.

    Attributes:
        source_lengths: ``[Ls]`` bytes per source token.
        target_lengths: ``[Lt]`` bytes per target token.
        chunk_starts: ``[C]`` byte position where each chunk starts (``chunk_starts[0] == 0``).
        source_chunk: ``[Ls]`` chunk index of each source token.
        target_chunk: ``[Lt]`` chunk index of each target token.
        bytes_match: True if both sides stand for the same bytes.
        common_prefix: Length in bytes of the longest common prefix of both sides.
        pair_target, pair_source, pair_weight, pair_overlap: parallel ``[K]`` lists, one
            entry per (target, source) token pair that shares mass (see module doc).
    """

    source_lengths: tuple[int, ...]
    target_lengths: tuple[int, ...]
    chunk_starts: tuple[int, ...]
    source_chunk: tuple[int, ...]
    target_chunk: tuple[int, ...]
    bytes_match: bool
    common_prefix: int
    pair_target: tuple[int, ...]
    pair_source: tuple[int, ...]
    pair_weight: tuple[float, ...]
    pair_overlap: tuple[float, ...]

    @property
    def num_chunks(self) -> int:
        """Number of chunks C."""
        return len(self.chunk_starts)

    def chunk_sizes(self) -> tuple[list[int], list[int]]:
        """Source and target token counts per chunk, each ``[C]``."""
        src, tgt = [0] * self.num_chunks, [0] * self.num_chunks
        for k in self.source_chunk:
            src[k] += 1
        for k in self.target_chunk:
            tgt[k] += 1
        return src, tgt

    def boundary_counts(self) -> tuple[int, int]:
        """(target interior boundaries that are also source boundaries, target interior boundaries).

        Interior boundaries are the end positions of target tokens with bytes, other than
        the end of the text; a source boundary only counts inside the common prefix.
        """
        src_ends = set(accumulate(self.source_lengths))
        total_t = sum(self.target_lengths)
        agreed = total = 0
        for end in set(accumulate(self.target_lengths)):
            if 0 < end < total_t:
                total += 1
                agreed += end in src_ends and end <= self.common_prefix
        return agreed, total


def _assign(lengths: Sequence[int], starts: Sequence[int]) -> list[int]:
    """Chunk index per token: tokens with bytes by their first byte, empty ones by the chunk ending at them."""
    out, k, pos, last = [], 0, 0, len(starts) - 1
    for n in lengths:
        if n:
            while k < last and starts[k + 1] <= pos:
                k += 1
        else:
            while k < last and starts[k + 1] < pos:
                k += 1
        out.append(k)
        pos += n
    return out


def _pairs(
    src_len: Sequence[int],
    tgt_len: Sequence[int],
    src_chunk: Sequence[int],
    tgt_chunk: Sequence[int],
    n_chunks: int,
    exact_chunks: int,
) -> tuple[list[int], list[int], list[float], list[float]]:
    """(target, source, weight, overlap) pairs per chunk; chunks >= exact_chunks split by target length."""
    by_chunk_s: list[list[int]] = [[] for _ in range(n_chunks)]
    by_chunk_t: list[list[int]] = [[] for _ in range(n_chunks)]
    for i, k in enumerate(src_chunk):
        by_chunk_s[k].append(i)
    for j, k in enumerate(tgt_chunk):
        by_chunk_t[k].append(j)
    src_start = [e - n for e, n in zip(accumulate(src_len), src_len)]
    tgt_start = [e - n for e, n in zip(accumulate(tgt_len), tgt_len)]
    pt: list[int] = []
    ps: list[int] = []
    pw: list[float] = []
    po: list[float] = []
    for k in range(n_chunks):
        srcs, tgts = by_chunk_s[k], by_chunk_t[k]
        if len(srcs) == 1 and len(tgts) == 1 and src_len[srcs[0]] and tgt_len[tgts[0]]:
            # One token with bytes on each side (most chunks): it takes all of the source token.
            pt.append(tgts[0]), ps.append(srcs[0]), pw.append(1.0), po.append(float(src_len[srcs[0]]))
            continue
        if not srcs or not tgts:
            continue
        full_t = [j for j in tgts if tgt_len[j]]
        empty_t = [j for j in tgts if not tgt_len[j]]
        for i in srcs:
            if not src_len[i]:  # EOS-like: to the empty targets of the chunk, else to its last target with bytes
                dest = empty_t or [full_t[-1]]
                for j in dest:
                    pt.append(j), ps.append(i), pw.append(1.0 / len(dest)), po.append(1.0 if empty_t else 0.0)
        if k >= exact_chunks:  # mismatch chunk: split each source token by target byte length
            total = sum(tgt_len[j] for j in full_t)
            dest = full_t or empty_t
            for i in srcs:
                if src_len[i]:
                    for j in dest:
                        share = tgt_len[j] / total if total else 1.0 / len(dest)
                        pt.append(j), ps.append(i), pw.append(share), po.append(share * src_len[i])
            continue
        a = [i for i in srcs if src_len[i]]
        ia = ib = 0
        while ia < len(a) and ib < len(full_t):  # two pointers over byte spans inside the chunk
            i, j = a[ia], full_t[ib]
            lo = max(src_start[i], tgt_start[j])
            hi = min(src_start[i] + src_len[i], tgt_start[j] + tgt_len[j])
            if hi > lo:
                pt.append(j), ps.append(i), pw.append((hi - lo) / src_len[i]), po.append(float(hi - lo))
            if src_start[i] + src_len[i] <= tgt_start[j] + tgt_len[j]:
                ia += 1
            else:
                ib += 1
    return pt, ps, pw, po


def align_lengths(
    source_lengths: Sequence[int], target_lengths: Sequence[int], common_prefix: int | None = None
) -> Alignment:
    """Align two segmentations given as bytes per token.

    Args:
        source_lengths: ``[Ls]`` int, bytes per source token (0 for special tokens).
        target_lengths: ``[Lt]`` int, bytes per target token.
        common_prefix: Bytes the two sides share from the start; ``None`` means the two
            sides stand for the same bytes (then the totals must be equal).

    Returns:
        The :class:`Alignment`.

    Raises:
        ValueError: If a length is negative, or ``common_prefix`` is None while the
            totals differ (pass the real common prefix, e.g. via :func:`align_bytes`).
    """
    src, tgt = [int(n) for n in source_lengths], [int(n) for n in target_lengths]
    if any(n < 0 for n in src) or any(n < 0 for n in tgt):
        raise ValueError(f"source_lengths / target_lengths: byte lengths must be >= 0, got {src} and {tgt}.")
    total_s, total_t = sum(src), sum(tgt)
    if common_prefix is None:
        if total_s != total_t:
            raise ValueError(
                f"source_lengths sum to {total_s} bytes but target_lengths to {total_t}; the sides stand for "
                "different texts. Use align_bytes, or pass common_prefix."
            )
        common_prefix = total_s
    match = total_s == total_t == common_prefix
    limit = max(total_s, total_t)
    shared = set(accumulate(src)) & set(accumulate(tgt))
    starts = [0] + sorted(p for p in shared if 0 < p <= common_prefix and p < limit)
    src_chunk, tgt_chunk = _assign(src, starts), _assign(tgt, starts)
    exact_chunks = len(starts) if match else len(starts) - 1
    pt, ps, pw, po = _pairs(src, tgt, src_chunk, tgt_chunk, len(starts), exact_chunks)
    return Alignment(
        tuple(src), tuple(tgt), tuple(starts), tuple(src_chunk), tuple(tgt_chunk), match, common_prefix,
        tuple(pt), tuple(ps), tuple(pw), tuple(po),
    )


def align_bytes(source_pieces: Sequence[bytes], target_pieces: Sequence[bytes]) -> Alignment:
    """Align two token sequences given as the bytes of each token (see :func:`.token_bytes`).

    Args:
        source_pieces: ``[Ls]`` bytes per source token.
        target_pieces: ``[Lt]`` bytes per target token.

    Returns:
        The :class:`Alignment`; ``bytes_match`` is False if the sides spell different bytes.
    """
    a, b = b"".join(source_pieces), b"".join(target_pieces)
    if a == b:
        common = len(a)
    else:
        common = 0
        limit = min(len(a), len(b))
        while common < limit and a[common] == b[common]:
            common += 1
    return align_lengths([len(p) for p in source_pieces], [len(p) for p in target_pieces], common)


def align_offsets(source_offsets: Sequence[tuple[int, int]], target_offsets: Sequence[tuple[int, int]]) -> Alignment:
    """Align two segmentations of one text given as contiguous (start, end) spans (docs/thl.md).

    Spans should be byte offsets: character offsets cannot express two tokenizers both
    cutting inside one character (the byte pieces of one emoji), and give a coarser alignment there.

    Args:
        source_offsets: ``[Ls]`` (start, end) spans, in order, covering the text.
        target_offsets: ``[Lt]`` (start, end) spans of the same text.

    Returns:
        The :class:`Alignment`.

    Raises:
        ValueError: If spans are not contiguous from 0, or the two sides end at
            different positions.
    """
    lengths = []
    for name, offsets in (("source_offsets", source_offsets), ("target_offsets", target_offsets)):
        pos, side = 0, []
        for k, (start, end) in enumerate(offsets):
            if end == start == 0 and pos > 0:  # an appended special token, e.g. EOS (0, 0)
                side.append(0)
                continue
            if start != pos or end < start:
                raise ValueError(
                    f"{name}[{k}] = {(start, end)}: spans must be contiguous from 0 (expected start {pos}); "
                    "use align_bytes with token bytes for overlapping character spans."
                )
            side.append(end - start)
            pos = end
        lengths.append(side)
    return align_lengths(lengths[0], lengths[1])
