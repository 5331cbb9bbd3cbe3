"""Acceptance: every ordered pair of the five real tokenizers (docs/thl.md).

For each text: exact round trip on both sides, mapped log-prob sums equal to the source
sums within 1e-5 nats, and every chunk boundary a token boundary on both sides.
"""

from __future__ import annotations

import itertools
import random
from itertools import accumulate

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from thl_cases import FIXED_CASES

from mrl_lightning.thl import (
    align_bytes,
    encode_completion,
    map_logprobs,
    token_bytes,
    transfer_trace,
)

NAMES = ("mistral-v1", "mistral-v3", "tekken", "byte-bpe", "char")
PAIRS = list(itertools.permutations(NAMES, 2))


def check_pair(source_tok, target_tok, text: str, seed: int = 0) -> None:
    """Assert the three acceptance properties for one text and one ordered pair."""
    data = text.encode("utf-8", "surrogateescape")
    src = encode_completion(source_tok, text)
    tgt = encode_completion(target_tok, text)
    src_pieces = token_bytes(source_tok, src.completion_ids)
    tgt_pieces = token_bytes(target_tok, tgt.completion_ids)
    assert b"".join(src_pieces) == data, f"source does not round-trip {text!r}"
    assert b"".join(tgt_pieces) == data, f"target does not round-trip {text!r}"
    assert src.round_trip_ok and tgt.round_trip_ok

    al = align_bytes(src_pieces, tgt_pieces)
    assert al.bytes_match
    src_bounds = {0, *accumulate(len(p) for p in src_pieces)}
    tgt_bounds = {0, *accumulate(len(p) for p in tgt_pieces)}
    for start in al.chunk_starts:
        assert start in src_bounds and start in tgt_bounds, (text, start)

    rng = random.Random(seed)
    lps = [-rng.uniform(0.0, 12.0) for _ in src_pieces]
    mapped = map_logprobs(lps, al)
    assert len(mapped) == len(tgt_pieces)
    assert abs(sum(mapped) - sum(lps)) <= 1e-5
    # chunk sums exact, not just the total
    for k in range(al.num_chunks):
        s = sum(lp for lp, c in zip(lps, al.source_chunk) if c == k)
        t = sum(lp for lp, c in zip(mapped, al.target_chunk) if c == k)
        assert abs(s - t) <= 1e-6, (text, k)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_fixed_cases_round_trip_and_conserve_logprob_mass(toks, source, target):
    for text in FIXED_CASES:
        check_pair(toks[source], toks[target], text)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_transfer_trace_maps_onto_receiver_tokens_with_eos(toks, source, target):
    src_tok, tgt_tok = toks[source], toks[target]
    text = " The answer is 68.\n\u4e2d\u6587 \U0001F600"
    src_ids = encode_completion(src_tok, text).completion_ids + [src_tok.eos_token_id]
    lps = [-0.5 - 0.1 * i for i in range(len(src_ids))]
    tr = transfer_trace(src_tok, src_ids, lps, tgt_tok, "Q: 12+56?\nA:", text, add_eos=True)
    assert tr.round_trip_ok
    assert tr.retokenized.completion_ids[-1] == tgt_tok.eos_token_id
    assert abs(sum(tr.logprobs) - sum(lps)) <= 1e-5
    # the source EOS log-prob lands on the receiver's EOS
    assert tr.logprobs[-1] == pytest.approx(lps[-1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=0, max_size=40))
def test_arbitrary_unicode_round_trips_for_all_pairs(toks, text):
    for source, target in PAIRS:
        check_pair(toks[source], toks[target], text)


SPACEY = st.text(alphabet=st.sampled_from(list(" \t\n\r0123456789abcXYZ.,-_<>/|\u2581\u00e9\u4e2d\U0001F600\u200d\u0301")), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SPACEY)
def test_whitespace_digit_and_marker_heavy_text_round_trips_for_all_pairs(toks, text):
    for source, target in PAIRS:
        check_pair(toks[source], toks[target], text)


def test_a_completion_cut_at_its_stop_string_round_trips_and_keeps_its_mass(toks):
    # the producer's ids spell the text and then the token that completed the stop (docs/rollout.md, "Stop
    # strings"): a round trip when the producer's stop is given, a failure (as before) when it is not
    src_tok, tgt_tok = toks["sp-bpe"], toks["byte-bpe"]
    text = " 36"
    src_ids = encode_completion(src_tok, text + "\n").completion_ids  # the newline token ended it
    lps = [-0.25 - 0.1 * i for i in range(len(src_ids))]
    cut = transfer_trace(src_tok, src_ids, lps, tgt_tok, "Q: 4*9?\nA:", text, add_eos=True, stop=["\n"])
    assert cut.round_trip_ok and cut.retokenized.completion_ids[-1] == tgt_tok.eos_token_id
    assert abs(sum(cut.logprobs) - sum(lps)) <= 1e-5
    assert not transfer_trace(src_tok, src_ids, lps, tgt_tok, "Q: 4*9?\nA:", text, add_eos=True).round_trip_ok
    # a tail without the stop is still a failure
    other = encode_completion(src_tok, text + "7").completion_ids
    assert not transfer_trace(src_tok, other, [-1.0] * len(other), tgt_tok, "Q", text, stop=["\n"]).round_trip_ok


def test_only_a_cut_at_the_first_stop_inside_the_last_token_counts_as_one():
    from mrl_lightning.thl.trace import _cut_at_stop

    text = b" 36"
    assert _cut_at_stop([b" 3", b"6", b"\n"], text, ["\n"], False)            # the newline token ended it
    assert _cut_at_stop([b" 3", b"6", b"\nQ"], text, ["\n"], False)           # that token went on past it
    assert _cut_at_stop([b" 3", b"6.\n"], b" 36.", ["\n"], False)              # it also holds text bytes
    assert not _cut_at_stop([b" 3", b"6", b"\n", b"Q"], text, ["\n"], False)  # tokens after the stopping one
    assert not _cut_at_stop([b" 3", b"6", b"7\n"], text, ["\n"], False)       # the tail does not start with it
    assert not _cut_at_stop([b" 3", b"6", b"\n"], text, [], False)             # no stop given
    assert _cut_at_stop([b" 3", b"6\nQ"], b" 36\n", ["\n"], True)             # kept in the text
    assert not _cut_at_stop([b" 3", b"6\n", b"Q"], b" 36\n", ["\n"], True)   # kept, then another token
