"""Mistral SentencePiece files built into fast tokenizers without transformers' converter (docs/thl.md, section 7).

The reference is mistral-common's own SentencePiece tokenizer: the ids must be the same on
every text that spells no control token, on every transformers release the project admits.
"""

from __future__ import annotations

import json
import random

import pytest

from mrl_lightning.thl import loader
from mrl_lightning.thl.loader import MISTRAL_FILES, load_tokenizer, mistral_data_dir
from mrl_lightning.thl.spm_fast import build_backend, sentencepiece_mismatches, unsupported_settings

SENTENCEPIECE = ("mistral-v1", "mistral-v3")
_PIECES = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \t\n.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`") + [
    "  ", "    ", "\u00e9", "e\u0301", "\u4e2d", "\u6587", "\U0001F600", "\u200d", "\u05d0", "\u0627", "\u00a0",
    "\u3000", "\r\n", "\u2581", "\ufeff", "\x00", "\U00010348", "\u00fc", "\u00df",
]
_WORDS = ["the", "answer", "is", "hello", "world", "Calculate", "def", "return", "1234", "na\u00efve", "\u6771\u4eac",
          "\u041f\u0440\u0438\u0432\u0435\u0442", "donn\u00e9es", "====", "----", "<0x41>", "[REFERENCE_DOC_1]",
          "[REFERENCE_DOC_19]", "REFERENCE_DOC_2]", "[REFERENCE_DOC_"]
_GAPS = ["", " ", "  ", "\n", "\t", " \n"]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Seeded texts mixing words, symbols, scripts, byte-fallback characters and space runs of 1-40."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 10)):
            parts.append(rng.choice(_WORDS) if rng.random() < 0.5
                         else "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 6))))
            parts.append(" " * rng.randint(1, 40) if rng.random() < 0.15 else rng.choice(_GAPS))
        texts.append("".join(parts))
    return texts


def _reference(name):
    from mistral_common.tokens.tokenizers.sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(str(mistral_data_dir() / MISTRAL_FILES[name]))


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_ids_and_decoding_match_mistral_common_on_random_texts(toks, name):
    ref, tok = _reference(name), toks[name]
    texts = _random_texts(1500) + [" " * n + w for n in range(50) for w in ("", "x", "\u6587")]
    wrong = [t for t in texts if tok(t)["input_ids"] != ref.encode(t, bos=True, eos=False)]
    assert wrong == [], (len(wrong), wrong[:3])
    undecoded = [t for t in texts if tok.decode(tok(t)["input_ids"], skip_special_tokens=True)
                 != ref.decode(ref.encode(t, bos=True, eos=False))]
    assert undecoded == [], undecoded[:3]


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_space_runs_split_into_sixteens_from_the_left_and_fifteen_as_fourteen_plus_one(toks, name):
    # Whitespace pieces exist for 1-14 and 16 spaces, all scored alike, so SentencePiece
    # merges leftmost first. Worked out by hand for "a" + n spaces + "b", whose last space
    # goes with "b" ("▁b"): a run of n - 1.
    expected = {2: [1], 15: [14], 16: [14, 1], 17: [16], 18: [16, 1], 32: [16, 14, 1], 33: [16, 16], 40: [16, 16, 7]}
    tok = toks[name]
    for n, runs in expected.items():
        pieces = tok.convert_ids_to_tokens(tok("a" + " " * n + "b", add_special_tokens=False)["input_ids"])
        assert pieces[0] == "\u2581a" and pieces[-1] == "\u2581b", (n, pieces)
        assert [len(p) for p in pieces[1:-1]] == runs and all(set(p) == {"\u2581"} for p in pieces[1:-1]), (n, pieces)


def test_v3_user_defined_pieces_are_matched_whole_longest_first(toks):
    tok = toks["mistral-v3"]
    ids = tok("see [REFERENCE_DOC_19] and [REFERENCE_DOC_1]x", add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert "[REFERENCE_DOC_19]" in pieces and "[REFERENCE_DOC_1]" in pieces
    assert pieces[pieces.index("[REFERENCE_DOC_1]") + 1] == "x"  # no merge across the piece, no dummy prefix after it
    assert ids == _reference("mistral-v3").encode("see [REFERENCE_DOC_19] and [REFERENCE_DOC_1]x", bos=False, eos=False)


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_text_spelling_a_control_token_is_read_as_that_token(toks, name):
    # The documented departure from SentencePiece (which reads "</s>" as 4 characters): the
    # Hugging Face convention that chat templates rely on.
    tok = toks[name]
    ids = tok("a</s>b", add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id in ids
    assert tok.eos_token_id not in _reference(name).encode("a</s>b", bos=False, eos=False)


def test_build_does_not_use_transformers_converter(monkeypatch):
    import importlib

    # The module itself: once transformers is imported, its package attribute of this name is the function.
    converter = importlib.import_module("transformers.convert_slow_tokenizer")
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' SentencePiece converter was called")

    monkeypatch.setattr(converter, "convert_slow_tokenizer", refuse)
    monkeypatch.setattr(converter.SpmConverter, "__init__", refuse)  # every SentencePiece converter's base
    source = mistral_data_dir() / MISTRAL_FILES["mistral-v1"]
    assert sentencepiece_mismatches(build_backend(source), source) == []


def _edited_model(tmp_path, edit):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((mistral_data_dir() / MISTRAL_FILES["mistral-v1"]).read_bytes())
    edit(proto)
    path = tmp_path / "edited.model"
    path.write_bytes(proto.SerializeToString())
    return path


def test_unsupported_model_is_refused_naming_every_field_and_value(tmp_path):
    def edit(proto):
        proto.trainer_spec.model_type = 1  # UNIGRAM
        proto.normalizer_spec.remove_extra_whitespaces = True
        proto.normalizer_spec.name = "nmt_nfkc"

    path = _edited_model(tmp_path, edit)
    with pytest.raises(ValueError) as err:
        build_backend(path)
    message = str(err.value)
    for expected in ("trainer_spec.model_type=UNIGRAM; supported: BPE", "remove_extra_whitespaces=True",
                     "normalizer_spec.name='nmt_nfkc'", "tokenizer.json", str(path)):
        assert expected in message
    assert unsupported_settings(_load(mistral_data_dir() / MISTRAL_FILES["mistral-v3"])) == []


def _load(path):
    from mrl_lightning.thl.spm_fast import _load_proto

    return _load_proto(path)


def test_a_build_that_disagrees_with_sentencepiece_is_refused_and_not_cached(tmp_path, monkeypatch):
    import mrl_lightning.thl.spm_fast as spm_fast

    monkeypatch.setattr(spm_fast, "sentencepiece_mismatches", lambda tok, source: [" hello"])
    with pytest.raises(RuntimeError, match=r"'mistral-v1'.*' hello'.*tokenizers \d.*transformers \d"):
        load_tokenizer("mistral-v1", cache_dir=tmp_path)
    assert not (tmp_path / "mistral-v1").exists()


@pytest.mark.parametrize("library", ["mistral_common", "tokenizers", "transformers", "sentencepiece"])
def test_cache_is_rebuilt_when_a_library_version_changes(tmp_path, monkeypatch, library):
    load_tokenizer("mistral-v1", cache_dir=tmp_path)
    marker = tmp_path / "mistral-v1" / "mrl_thl_source.json"
    before = json.loads(marker.read_text())
    assert before[library] == loader._version(library)
    real = loader._version
    monkeypatch.setattr(loader, "_version", lambda lib: "0.0.0-other" if lib == library else real(lib))
    assert loader.cache_key("mistral-v1") != before
    load_tokenizer("mistral-v1", cache_dir=tmp_path)
    assert json.loads(marker.read_text())[library] == "0.0.0-other"


def test_cache_is_rebuilt_when_the_source_file_changes(tmp_path, monkeypatch):
    load_tokenizer("mistral-v1", cache_dir=tmp_path)
    marker = tmp_path / "mistral-v1" / "mrl_thl_source.json"
    monkeypatch.setattr(loader, "_sha256", lambda path: "0" * 64)
    assert not loader._cache_is_current(tmp_path / "mistral-v1", "mistral-v1")
    load_tokenizer("mistral-v1", cache_dir=tmp_path)
    assert json.loads(marker.read_text())["sha256"] == "0" * 64
