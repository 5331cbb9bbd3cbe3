"""align_* and the trace mapping, with expected values worked out by hand (docs/thl.md)."""

from __future__ import annotations

from itertools import accumulate

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl_lightning.thl import (
    align_bytes,
    align_lengths,
    align_offsets,
    map_logprobs,
    map_mask,
    map_sequence_advantage,
    map_terminal_reward,
    map_token_values,
)

# source "ab|c|de|!"  target "a|bc|d|e|!": shared interior boundaries 3 and 5 -> chunks [0,3) [3,5) [5,6)
SRC = [b"ab", b"c", b"de", b"!"]
TGT = [b"a", b"bc", b"d", b"e", b"!"]


def test_chunks_are_maximal_spans_with_shared_boundaries():
    al = align_bytes(SRC, TGT)
    assert al.bytes_match and al.chunk_starts == (0, 3, 5)
    assert al.source_chunk == (0, 0, 1, 2)
    assert al.target_chunk == (0, 0, 1, 1, 2)
    assert al.chunk_sizes() == ([2, 1, 1], [2, 2, 1])
    assert al.boundary_counts() == (2, 4)  # target interior ends 1,3,4,5; source has 3 and 5


def test_logprobs_split_by_overlapped_bytes_inside_chunks():
    al = align_bytes(SRC, TGT)
    # a <- half of ab; bc <- half of ab + all of c; d, e <- halves of de; ! <- !
    assert map_logprobs([-1.0, -2.0, -4.0, -3.0], al) == pytest.approx([-0.5, -2.5, -2.0, -2.0, -3.0])


def test_many_source_tokens_into_one_target_token_sum_exactly():
    al = align_bytes([b"1", b"2", b"3"], [b"123"])
    assert map_logprobs([-0.1, -0.2, -0.3], al) == pytest.approx([-0.6])


def test_mask_maps_with_any_over_the_chunk():
    al = align_bytes(SRC, TGT)
    assert map_mask([True, False, False, True], al) == [True, True, False, False, True]
    assert map_mask([False, True, False, False], al) == [True, True, False, False, False]


def test_token_values_are_byte_weighted_means():
    al = align_bytes(SRC, TGT)
    assert map_token_values([1.0, 3.0, 5.0, 7.0], al) == pytest.approx([1.0, 2.0, 5.0, 5.0, 7.0])


def test_sequence_advantage_broadcasts_and_terminal_reward_sits_on_last_token():
    al = align_bytes(SRC, TGT)
    assert map_sequence_advantage(-0.75, al) == [-0.75] * 5
    assert map_terminal_reward(1.0, al) == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert map_terminal_reward(1.0, align_bytes([], [])) == []


def test_source_eos_goes_to_target_eos_or_else_to_last_text_token():
    both = align_bytes([b"hi", b""], [b"h", b"i", b""])
    assert map_logprobs([-1.0, -0.25], both) == pytest.approx([-0.5, -0.5, -0.25])
    no_target_eos = align_bytes([b"hi", b""], [b"h", b"i"])
    assert map_logprobs([-1.0, -0.25], no_target_eos) == pytest.approx([-0.5, -0.75])
    only_target_eos = align_bytes([b"hi"], [b"h", b"i", b""])
    assert map_logprobs([-1.0], only_target_eos) == pytest.approx([-0.5, -0.5, 0.0])
    assert map_token_values([2.0], only_target_eos) == pytest.approx([2.0, 2.0, 2.0])


def test_different_tails_form_one_mismatch_chunk_that_still_conserves_mass():
    # source kept the cut bytes of an emoji, target got U+FFFD from decode(errors="replace")
    al = align_bytes([b"o", b"k", b"\xf0\x9f"], [b"ok", b"\xef", b"\xbf\xbd"])
    assert not al.bytes_match and al.common_prefix == 2 and al.chunk_starts == (0, 2)
    # chunk 0 exact; chunk 1: -3 split by target byte length 1:2
    assert map_logprobs([-1.0, -2.0, -3.0], al) == pytest.approx([-3.0, -1.0, -2.0])


def test_align_offsets_accepts_contiguous_spans_and_rejects_gaps():
    al = align_offsets([(0, 2), (2, 3), (3, 5)], [(0, 1), (1, 3), (3, 5), (0, 0)])
    assert al.chunk_starts == (0, 3) and al.target_lengths == (1, 2, 2, 0)
    with pytest.raises(ValueError, match=r"source_offsets\[1\]"):
        align_offsets([(0, 2), (3, 5)], [(0, 5)])
    with pytest.raises(ValueError, match="different texts"):
        align_lengths([2, 3], [4])
    with pytest.raises(ValueError, match=">= 0"):
        align_lengths([-1, 2], [1])
    with pytest.raises(ValueError, match="source_logprobs: has 2 entries"):
        map_logprobs([-1.0, -2.0], align_bytes(SRC, TGT))


@st.composite
def two_segmentations(draw):
    data = draw(st.binary(min_size=0, max_size=40))
    cuts = st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))

    def split(points):
        points = sorted(p for p in points if 0 < p < len(data))
        edges = [0, *points, len(data)]
        return [data[a:b] for a, b in zip(edges, edges[1:]) if b > a]

    src, tgt = split(draw(cuts)), split(draw(cuts))
    if draw(st.booleans()):
        src = src + [b""]  # a sampled EOS
    lps = draw(st.lists(st.floats(-20.0, 0.0), min_size=len(src), max_size=len(src)))
    mask = draw(st.lists(st.booleans(), min_size=len(src), max_size=len(src)))
    return src, tgt, lps, mask


@settings(max_examples=100, deadline=None)
@given(two_segmentations())
def test_random_segmentations_chunk_on_shared_boundaries_and_conserve_chunk_sums(case):
    src, tgt, lps, mask = case
    al = align_bytes(src, tgt)
    src_ends, tgt_ends = set(accumulate(map(len, src))), set(accumulate(map(len, tgt)))
    ends = list(al.chunk_starts[1:]) + [sum(map(len, tgt))]
    for start in al.chunk_starts[1:]:
        assert start in src_ends and start in tgt_ends
    # maximal: no shared interior boundary is left out
    assert set(al.chunk_starts[1:]) == {p for p in src_ends & tgt_ends if 0 < p < ends[-1]}
    for pieces, chunks in ((src, al.source_chunk), (tgt, al.target_chunk)):
        pos = 0
        for piece, k in zip(pieces, chunks):
            if piece:
                assert al.chunk_starts[k] <= pos and pos + len(piece) <= ends[k]
            pos += len(piece)
    mapped = map_logprobs(lps, al)
    if not tgt:  # nothing to carry the mass: the only case where it is lost (residual counts it)
        assert mapped == []
        return
    for k in range(al.num_chunks):
        s = sum(lp for lp, c in zip(lps, al.source_chunk) if c == k)
        t = sum(lp for lp, c in zip(mapped, al.target_chunk) if c == k)
        assert t == pytest.approx(s, abs=1e-9)
    tmask = map_mask(mask, al)
    for t, k in enumerate(al.target_chunk):
        assert tmask[t] == any(m for m, c in zip(mask, al.source_chunk) if c == k)
