"""load_tokenizer (mistral-common names, leading-space fix) and per-token byte recovery (docs/thl.md)."""

from __future__ import annotations

import shutil

import pytest

from mrl_lightning.thl import (
    byte_table,
    decode_completion,
    fix_leading_space,
    leading_space_failures,
    token_bytes,
)
from mrl_lightning.thl.loader import load_tokenizer, mistral_data_dir
from mrl_lightning.thl.token_bytes import gpt2_byte_to_unicode

ALL = ("mistral-v1", "mistral-v3", "tekken", "byte-bpe", "char", "sp-bpe")
NATURAL = (
    "The answer is 42.",
    " leading space",
    "  two leading spaces",
    "tabs\tand\nnewlines\n",
    "\u4e2d\u6587 and \U0001F600 and e\u0301",
    "12345 + 67890",
    "",
)
LEADING = [
    f"{pre}{word}{post}"
    for pre in (" ", "  ", " \t", "   ")
    for word in ("hello", "68", "The answer is 42.", "x = 1", "\u4e2d\u6587", "caf\u00e9", "(a)", "\U0001F600 ok")
    for post in ("", " ", "\n")
]


@pytest.fixture(scope="module")
def v1_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v1_raw")
    shutil.copyfile(mistral_data_dir() / "tokenizer.model.v1", folder / "tokenizer.model")
    return folder


def test_default_hf_route_for_mistral_v1_loses_leading_spaces_and_the_fix_restores_them(v1_model_dir):
    from transformers import LlamaTokenizerFast

    naive = LlamaTokenizerFast.from_pretrained(str(v1_model_dir))  # what a new user writes
    assert len(naive) == 32000
    lost = leading_space_failures(naive, tuple(LEADING))
    assert len(lost) >= len(LEADING) // 20, "the known bug did not show: re-measure it and update docs/thl.md"
    assert all(text[:1].isspace() for text in lost)
    assert fix_leading_space(naive)
    assert leading_space_failures(naive, tuple(LEADING)) == []
    assert not fix_leading_space(naive)  # nothing left to fix: idempotent


def test_load_tokenizer_mistral_v1_matches_sentencepiece_and_round_trips(toks, v1_model_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(v1_model_dir / "tokenizer.model"))
    tok = toks["mistral-v1"]
    assert leading_space_failures(tok, tuple(LEADING)) == []
    for text in (*LEADING, *NATURAL):
        assert tok(text)["input_ids"] == [sp.bos_id(), *sp.encode(text)], text


def test_load_tokenizer_tekken_matches_mistral_common(toks):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    ref = Tekkenizer.from_file(str(mistral_data_dir() / "tekken_240911.json"))
    tok = toks["tekken"]
    for text in (*LEADING[:12], *NATURAL):
        assert tok(text)["input_ids"] == ref.encode(text, bos=True, eos=False), text


def test_mistral_tokenizers_add_bos_and_have_expected_sizes(toks):
    for name, size in (("mistral-v1", 32000), ("mistral-v3", 32768), ("tekken", 131072)):
        tok = toks[name]
        assert len(tok) == size
        assert tok("hi")["input_ids"][0] == tok.bos_token_id == 1 and tok.eos_token_id == 2


def test_cached_conversion_is_reused(thl_cache, toks):
    marker = thl_cache / "tekken" / "mrl_thl_source.json"
    assert marker.exists()
    stamp = marker.stat().st_mtime_ns
    again = load_tokenizer("tekken", cache_dir=thl_cache)
    assert marker.stat().st_mtime_ns == stamp
    assert again("hello world")["input_ids"] == toks["tekken"]("hello world")["input_ids"]


def test_unknown_spec_error_names_value_and_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"mistral-v1.*mistral-v3.*tekken"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="tokenizer spec"):
        load_tokenizer("")


def test_gpt2_byte_table_is_a_bijection_onto_printable_characters():
    table = gpt2_byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert not any(ch.isspace() for ch in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"


@pytest.mark.parametrize("name", ALL)
def test_token_bytes_of_native_full_text_encoding_spell_the_text(toks, name):
    tok = toks[name]
    for text in NATURAL:
        ids = tok(text)["input_ids"]
        assert b"".join(token_bytes(tok, ids, strip_dummy_prefix=True)) == text.encode(), (name, text)


@pytest.mark.parametrize("name", ALL)
def test_special_tokens_have_no_bytes(toks, name):
    tok = toks[name]
    assert token_bytes(tok, tok.all_special_ids) == [b""] * len(tok.all_special_ids)


def test_sentencepiece_pieces_map_marker_and_byte_fallback(toks):
    tok = toks["mistral-v1"]
    table = byte_table(tok)
    assert table.scheme == "metaspace" and table.dummy_prefix
    ids = tok.convert_tokens_to_ids(["<0x41>", "\u2581hell", "<0xF0>", "\u2581\u2581"])
    assert token_bytes(tok, ids) == [b"A", b" hell", b"\xf0", b"  "]
    assert len(table.byte_ids) == 256
    tek = byte_table(toks["tekken"])
    assert tek.scheme == "byte_level" and len(tek.byte_ids) == 256


def test_decode_completion_handles_cut_characters(toks):
    tok = toks["byte-bpe"]
    ids = tok("ok \U0001F600", add_special_tokens=False)["input_ids"][:-1]
    raw = b"".join(token_bytes(tok, ids))
    assert decode_completion(tok, ids, errors="replace").endswith("\ufffd")
    assert decode_completion(tok, ids, errors="surrogateescape").encode("utf-8", "surrogateescape") == raw
    with pytest.raises(UnicodeDecodeError):
        decode_completion(tok, ids)
