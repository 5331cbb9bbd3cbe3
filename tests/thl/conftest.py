"""Session-scoped real tokenizers for the THL tests (converted once per session).

The five tokenizers THL must handle (docs/thl.md): Mistral SentencePiece v1 and v3 and Tekken from the
mistral-common wheel, plus the project's own byte-level BPE and character-level ones
(trained here with mrl_lightning.recipes.tokenizers on a small task-like corpus).
Conversions go to a session temp cache, so the conversion path itself is exercised.
"""

from __future__ import annotations

import pytest

from mrl_lightning.recipes.tokenizers import (
    train_byte_level_bpe,
    train_char_level,
    train_sentencepiece_bpe,
)
from mrl_lightning.thl.loader import load_tokenizer

CORPUS = [
    f"Question: what is {a} + {b}? Answer: {a + b}. The sum of {a} and {b} is {a + b}."
    for a in range(0, 60, 7)
    for b in range(3, 90, 11)
] + [
    "def add(x, y):\n    return x + y\n",
    "Let's think step by step. First, we add the tens; then the ones.",
    "The quick brown fox jumps over the lazy dog.",
]

NAMES = ("mistral-v1", "mistral-v3", "tekken", "byte-bpe", "char")


@pytest.fixture(scope="session")
def thl_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("thl_cache")


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("thl_trained")
    train_byte_level_bpe(CORPUS, 400, root / "byte-bpe")
    train_char_level(CORPUS, root / "char")
    train_sentencepiece_bpe(CORPUS, 400, root / "sp-bpe")
    return root


@pytest.fixture(scope="session")
def toks(thl_cache, tokenizer_dirs):
    """name -> fast tokenizer, all loaded through load_tokenizer as a user would."""
    out = {name: load_tokenizer(name, cache_dir=thl_cache) for name in ("mistral-v1", "mistral-v3", "tekken")}
    out["byte-bpe"] = load_tokenizer(str(tokenizer_dirs / "byte-bpe"))
    out["char"] = load_tokenizer(str(tokenizer_dirs / "char"))
    out["sp-bpe"] = load_tokenizer(str(tokenizer_dirs / "sp-bpe"))
    return out
