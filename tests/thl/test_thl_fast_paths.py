"""The fast paths of THL's alignment and character offsets give the defined values (docs/thl.md).

``align_lengths`` hands a chunk with one token with bytes on each side its single pair
directly, and ``char_offsets`` reads the bytes per character of non-ASCII text from code
points. Both are checked here against plain restatements of their definitions, on random
segmentations with different tails, byte-less tokens, 1- to 4-byte characters and
surrogate-escaped bytes.
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest

from mrl_lightning.thl import align_bytes
from mrl_lightning.thl.retokenize import char_offsets


def reference_pairs(src: list[bytes], tgt: list[bytes]) -> dict[tuple[int, int], tuple[float, float]]:
    """(target, source) -> (weight, overlap) from the definitions in docs/thl.md, section 4."""
    al = align_bytes(src, tgt)
    s_len, t_len = [len(p) for p in src], [len(p) for p in tgt]
    s_start = [e - n for e, n in zip(accumulate(s_len), s_len)]
    t_start = [e - n for e, n in zip(accumulate(t_len), t_len)]
    exact = al.num_chunks if al.bytes_match else al.num_chunks - 1
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for k in range(al.num_chunks):
        srcs = [i for i, c in enumerate(al.source_chunk) if c == k]
        full = [j for j, c in enumerate(al.target_chunk) if c == k and t_len[j]]
        empty = [j for j, c in enumerate(al.target_chunk) if c == k and not t_len[j]]
        if not srcs or not (full or empty):
            continue
        for i in srcs:
            if not s_len[i]:
                dest = empty or [full[-1]]
                for j in dest:
                    out[j, i] = (1.0 / len(dest), 1.0 if empty else 0.0)
            elif k >= exact:  # mismatch chunk: by target byte length
                dest, total = full or empty, sum(t_len[j] for j in full)
                for j in dest:
                    share = t_len[j] / total if total else 1.0 / len(dest)
                    out[j, i] = (share, share * s_len[i])
            else:
                for j in full:
                    overlap = min(s_start[i] + s_len[i], t_start[j] + t_len[j]) - max(s_start[i], t_start[j])
                    if overlap > 0:
                        out[j, i] = (overlap / s_len[i], float(overlap))
    return out


def _segment(rng: random.Random, data: bytes) -> list[bytes]:
    pieces, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, 4)
        pieces.append(data[pos : pos + n])
        pos += n
        if rng.random() < 0.05:
            pieces.append(b"")  # a special token inside
    if rng.random() < 0.3:
        pieces.append(b"")  # a sampled EOS
    return pieces


def test_alignment_pairs_match_their_definition_on_random_segmentations():
    rng = random.Random(0)
    for _ in range(1500):
        data = bytes(rng.choice(b"abc") for _ in range(rng.randint(0, 25)))
        other = data if rng.random() < 0.7 else data[: rng.randint(0, len(data))] + b"xy"
        src, tgt = _segment(rng, data), _segment(rng, other)
        al = align_bytes(src, tgt)
        got = {(j, i): (w, o) for j, i, w, o in zip(al.pair_target, al.pair_source, al.pair_weight, al.pair_overlap)}
        assert len(got) == len(al.pair_target), (src, tgt)  # no pair twice
        want = reference_pairs(src, tgt)
        assert got.keys() == want.keys(), (src, tgt)
        for key, (w, o) in want.items():
            assert got[key] == (pytest.approx(w), pytest.approx(o)), (src, tgt, key)


def test_one_token_each_side_takes_the_whole_source_token_even_in_a_mismatch_chunk():
    al = align_bytes([b"ab", b"cd"], [b"ab", b"xyz"])  # different tails: [2, 5) is the mismatch chunk
    assert not al.bytes_match and al.chunk_starts == (0, 2)
    assert list(zip(al.pair_target, al.pair_source, al.pair_weight, al.pair_overlap)) == [
        (0, 0, 1.0, 2.0),
        (1, 1, 1.0, 2.0),
    ]


def reference_char_offsets(text: str, lengths: list[int]) -> list[tuple[int, int]]:
    """Character span of each byte piece, walking the text one character at a time."""
    char_of_byte = [k for k, c in enumerate(text) for _ in c.encode("utf-8", "surrogateescape")]
    n_bytes, n_chars = len(char_of_byte), len(text)
    out, pos = [], 0
    for n in lengths:
        start = char_of_byte[pos] if pos < n_bytes else n_chars
        if n == 0:
            out.append((start, start))
        else:
            last = pos + n - 1
            out.append((start, char_of_byte[last] + 1 if last < n_bytes else n_chars))
        pos += n
    return out


@pytest.mark.parametrize("seed", range(3))
def test_char_offsets_of_non_ascii_text_match_a_character_walk(seed):
    rng = random.Random(seed)
    alphabet = ["a", " ", "\x7f", "\u00e9", "\u07ff", "\u0800", "\u4e2d", "\uffff", "\U00010000", "\U0001F600",
                "\udc80", "\udcff"]  # 1-4 byte characters; the last two are surrogate-escaped bytes (1 byte each)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        size = len(text.encode("utf-8", "surrogateescape"))
        lengths, pos = [], 0
        while pos < size:
            lengths.append(rng.randint(0, 5))
            pos += lengths[-1]
        lengths.append(0)  # an appended EOS
        got = char_offsets(text, lengths)
        assert got == reference_char_offsets(text, lengths), (text, lengths)
        assert all(type(v) is int for span in got for v in span)
