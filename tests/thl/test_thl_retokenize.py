"""retokenize / encode_completion / tokenizer_fingerprint on real tokenizers (docs/thl.md)."""

from __future__ import annotations

import pytest
from thl_cases import FIXED_CASES

from mrl_lightning.thl import (
    decode_completion,
    encode_completion,
    retokenize,
    token_bytes,
    tokenizer_fingerprint,
)

ALL = ("mistral-v1", "mistral-v3", "tekken", "byte-bpe", "char", "sp-bpe")
PLAIN = [t for t in FIXED_CASES if "\ufffd" not in t and not any("\udc80" <= c <= "\udcff" for c in t)]


@pytest.mark.parametrize("name", ALL)
def test_completion_decodes_to_exact_text_without_special_tokens(toks, name):
    tok = toks[name]
    special = set(tok.all_special_ids)
    for text in PLAIN:
        r = retokenize(tok, "Question: 12+56=?\nAnswer:", text)
        assert decode_completion(tok, r.completion_ids) == text
        assert not special.intersection(r.completion_ids), (name, text, r.completion_ids)
        assert r.round_trip_ok and not r.invalid_utf8_tail
        assert len(r.completion_offsets) == len(r.completion_ids)


@pytest.mark.parametrize("name", ALL)
def test_prompt_ids_are_exactly_the_tokenizers_own_encoding(toks, name):
    tok = toks[name]
    for prompt in ("Question: 12+56=?\nAnswer:", " leading", ""):
        r = retokenize(tok, prompt, " 68")
        assert r.prompt_ids == tok(prompt)["input_ids"]
        r2 = retokenize(tok, prompt, " 7")  # second call hits the prompt cache
        assert r2.prompt_ids == tok(prompt)["input_ids"]
        r2.prompt_ids.append(-1)  # the cache hands out copies
        assert retokenize(tok, prompt, "x").prompt_ids == tok(prompt)["input_ids"]


@pytest.mark.parametrize("name", ["mistral-v1", "mistral-v3", "sp-bpe"])
def test_leading_space_has_no_dummy_prefix_on_sentencepiece(toks, name):
    tok = toks[name]
    r = retokenize(tok, "x =", " 68")
    pieces = token_bytes(tok, r.completion_ids)
    assert b"".join(pieces) == b" 68"  # not b"  68" (extra dummy prefix) and not b"68"
    assert not r.used_fallback  # the tokenizer's own encoder did it, with the prefix disabled
    # tokenizer.decode strips the first space as if it were the dummy prefix; decode_completion keeps it
    assert tok.decode(r.completion_ids) == "68"
    assert decode_completion(tok, r.completion_ids) == " 68"


@pytest.mark.parametrize("name", ["mistral-v1", "mistral-v3", "tekken", "byte-bpe", "sp-bpe"])
@pytest.mark.parametrize(
    "prompt,completion",
    [
        ("Question: what is 12 + 56? Answer:", " The answer is 68. Done"),  # completion starts with a space
        ("Question: what is 12 + 5", "6? Answer: 68"),  # completion continues a number: no dummy prefix
    ],
)
def test_completion_ids_match_in_context_tokenization_at_a_token_boundary(toks, name, prompt, completion):
    tok = toks[name]
    full = tok(prompt + completion, add_special_tokens=False)["input_ids"]
    head = tok(prompt, add_special_tokens=False)["input_ids"]
    assert full[: len(head)] == head, "test precondition: prompt is a token prefix of the full text"
    r = retokenize(tok, prompt, completion)
    assert r.completion_ids == full[len(head) :]
    assert not r.used_fallback


@pytest.mark.parametrize("name", ALL)
def test_special_token_strings_stay_text(toks, name):
    tok = toks[name]
    for text in ("</s>", "<s>", "<|endoftext|>", "<0x41>", "[INST]", "<unk>"):
        r = retokenize(tok, "", text)
        assert decode_completion(tok, r.completion_ids) == text
        assert not set(tok.all_special_ids).intersection(r.completion_ids), (name, text)
    # and the byte-fallback look-alike is not the byte piece <0x41> ("A")
    ids = retokenize(tok, "", "<0x41>").completion_ids
    assert len(ids) > 1


@pytest.mark.parametrize("name", ALL)
def test_eos_appended_iff_requested_with_empty_offsets(toks, name):
    tok = toks[name]
    without = retokenize(tok, "p", " hi there")
    with_eos = retokenize(tok, "p", " hi there", add_eos=True)
    assert with_eos.completion_ids == without.completion_ids + [tok.eos_token_id]
    assert with_eos.completion_offsets == without.completion_offsets + [(0, 0)]
    assert tok.eos_token_id not in without.completion_ids


def test_offsets_cover_characters_and_byte_pieces_share_their_character(toks):
    tok = toks["mistral-v1"]
    text = "ab \U0001F468 c\u0301"  # U+1F468 has no piece in v1: 4 <0xHH> pieces
    r = retokenize(tok, "", text)
    pieces = token_bytes(tok, r.completion_ids)
    for (start, end), piece in zip(r.completion_offsets, pieces):
        assert 0 <= start < end <= len(text)
    emoji_tokens = [off for off, p in zip(r.completion_offsets, pieces) if len(p) == 1 and p[0] >= 0x80]
    assert emoji_tokens and all(off == (3, 4) for off in emoji_tokens)  # 4 byte pieces of one character
    assert len(emoji_tokens) == 4
    assert r.completion_offsets[0][0] == 0
    assert r.completion_offsets[-1][1] == len(text)


@pytest.mark.parametrize("name", ALL)
def test_ascii_offsets_tile_the_text(toks, name):
    tok = toks[name]
    text = "  The answer:\n\t42 + 7 = 49  "
    r = retokenize(tok, "", text)
    assert "".join(text[s:e] for s, e in r.completion_offsets) == text


@pytest.mark.parametrize("name", ALL)
def test_completion_cut_inside_a_character_is_flagged(toks, name):
    tok = toks[name]
    raw = "ok \U0001F600".encode()[:-2]  # generation stopped two bytes into the emoji
    escaped = raw.decode("utf-8", "surrogateescape")
    r = retokenize(tok, "", escaped)
    assert r.invalid_utf8_tail and r.round_trip_ok
    assert b"".join(token_bytes(tok, r.completion_ids)) == raw  # the cut bytes are kept exactly
    replaced = raw.decode("utf-8", "replace")  # what tokenizer.decode gives
    assert replaced.endswith("\ufffd")
    assert retokenize(tok, "", replaced).invalid_utf8_tail
    assert not retokenize(tok, "", "ok \U0001F600").invalid_utf8_tail


def test_literal_sentencepiece_marker_falls_back_to_exact_byte_pieces(toks):
    tok = toks["mistral-v1"]
    r = retokenize(tok, "", "a\u2581b")
    assert r.used_fallback and r.round_trip_ok
    assert decode_completion(tok, r.completion_ids) == "a\u2581b"
    assert tok.convert_ids_to_tokens(r.completion_ids) == ["a", "<0xE2>", "<0x96>", "<0x81>", "b"]


def test_bad_inputs_raise_clear_errors(toks):
    tok = toks["byte-bpe"]
    with pytest.raises(ValueError, match="lone surrogate"):
        retokenize(tok, "", "a\ud800b")
    with pytest.raises(TypeError, match="completion_text"):
        retokenize(tok, "", b"bytes")
    with pytest.raises(TypeError, match="prompt_text"):
        retokenize(tok, None, "x")
    with pytest.raises(TypeError, match="fast tokenizer"):
        retokenize(object(), "", "x")
    with pytest.raises(ValueError, match="not ids of this tokenizer"):
        token_bytes(tok, [len(tok) + 5])


def test_fingerprint_is_stable_and_tells_tokenizers_apart(toks, thl_cache):
    from mrl_lightning.thl import load_tokenizer

    prints = {name: tokenizer_fingerprint(toks[name]) for name in ALL}
    assert len(set(prints.values())) == len(ALL)
    assert all(len(p) == 16 and int(p, 16) >= 0 for p in prints.values())
    again = load_tokenizer("mistral-v1", cache_dir=thl_cache)  # a fresh object from the cache
    assert tokenizer_fingerprint(again) == prints["mistral-v1"]


def test_retokenize_is_fast_enough_for_the_training_loop(toks):
    import time

    tok = toks["tekken"]
    completion = " The answer is 68, because 12 plus 56 equals 68."
    encode_completion(tok, completion)
    start = time.perf_counter()
    for i in range(300):
        retokenize(tok, f"What is {i // 8} + 56? Answer:", completion)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.25, f"300 retokenize calls took {elapsed:.3f} s (budget 50 ms on an idle core)"
