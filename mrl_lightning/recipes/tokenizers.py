"""Train small tokenizers locally and save them as Hugging Face fast tokenizers.

The embedded default (docs/default.md) needs two policies whose tokenizers really differ,
and on a CPU the vocabulary size dominates cost (the log_softmax over V at every
position), so we train small vocabularies on task text with the ``tokenizers`` library,
save them with ``save_pretrained`` and load them back through
``AutoTokenizer.from_pretrained``, the same path a user's hub tokenizer takes.

Trained kinds:

- ``byte_level_bpe``: GPT-2 style byte-level BPE; digits are split one per token
  (multi-digit merges made the warm-start ~10x slower in a prototype), words and spaces merge.
- ``sentencepiece_bpe``: Llama/SentencePiece style BPE over ``▁``-marked words with a
  dummy prefix and ``<0xHH>`` byte fallback; digits split.
- ``char_level``: one token per character seen in training, byte fallback for the rest.
- ``qwen2_bpe``: Qwen2 style byte-level BPE: NFC-normalized, with Qwen2's pre-tokenizer
  (:data:`QWEN2_SPLIT`): one digit per piece, a word may take one leading punctuation mark
  (``f(x)`` gives ``f``, ``(x``, ``)``) and a punctuation run its line break (``.\n``),
  where the GPT-2 style cuts ``(``, ``x`` and ``.``, ``\n``; EOS ``<|endoftext|>``, no BOS
  (as Qwen2's).

Real kinds, the production tokenizers shipped in the mistral-common wheel at their full
vocabulary, loaded through THL's loader (:func:`mrl_lightning.thl.loader.load_tokenizer`,
docs/thl.md): ``mistral_v1`` (SentencePiece, 32,000), ``mistral_v3`` (SentencePiece with
control tokens ``[INST]`` / ``[/INST]``, 32,768) and ``tekken`` (131,072). On a CPU the
vocabulary dominates the cost (the output layer and softmax over V at every position): a
2-layer, width-128 model with tied embeddings has 4.5 M parameters at 32,768 tokens and
17.1 M at 131,072 (0.37 M at 300); keep such a model narrow (width 64: 2.2 M at 32,768).

pad == eos for every kind (the common case that the completion mask must survive);
Tekken brings a ``<pad>`` of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

REAL_KINDS = {"mistral_v1": "mistral-v1", "mistral_v3": "mistral-v3", "tekken": "tekken"}
"""Real kind -> its name in :func:`mrl_lightning.thl.loader.load_tokenizer`."""
REAL_VOCAB = {"mistral_v1": 32_000, "mistral_v3": 32_768, "tekken": 131_072}
TOKENIZER_KINDS = ("byte_level_bpe", "sentencepiece_bpe", "char_level", "qwen2_bpe", *REAL_KINDS)
# Qwen2's pre-tokenization: contractions (any case), a word with at most one leading
# non-letter, one digit, punctuation runs with their line ends, line breaks, other spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTE_PIECES = [f"<0x{i:02X}>" for i in range(256)]


def _wrap(tok: Tokenizer, *, bos: str | None, eos: str, unk: str | None, add_bos: bool) -> PreTrainedTokenizerFast:
    if add_bos:
        from tokenizers.processors import TemplateProcessing

        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        unk_token=unk,
        clean_up_tokenization_spaces=False,
    )


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE, digits split; saved to ``out_dir``.

    Args:
        texts: Training corpus.
        vocab_size: Target vocabulary size (>= 257: 256 byte symbols + ``<|endoftext|>``).
        out_dir: Folder written with ``save_pretrained``.

    Raises:
        ValueError: ``vocab_size`` below 257.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use >= 257.")
    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    hf = _wrap(tok, bos=eos, eos=eos, unk=None, add_bos=False)
    hf.save_pretrained(str(out_dir))
    return hf


def train_sentencepiece_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Llama/SentencePiece style BPE with ``▁`` word marks, dummy prefix and byte fallback.

    Args:
        texts: Training corpus.
        vocab_size: Target size on top of the 3 specials and 256 ``<0xHH>`` byte pieces.
        out_dir: Folder written with ``save_pretrained``.

    Raises:
        ValueError: ``vocab_size`` too small to hold the byte pieces.
    """
    if vocab_size < 260:
        raise ValueError(f"vocab_size={vocab_size} cannot hold 3 specials + 256 byte pieces; use >= 260.")
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
         pre_tokenizers.Split("▁", behavior="merged_with_next")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = list(texts)
    alphabet = sorted({c for t in corpus for c in t.replace(" ", "▁")} | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_BYTE_PIECES),
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # Byte pieces must be ordinary vocabulary entries (as in SentencePiece), not added
    # special tokens: otherwise skip_special_tokens would drop them on decode.
    trained = json.loads(tok.to_str())["model"]
    learned = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    vocab = {s: i for i, s in enumerate(specials + _BYTE_PIECES)}
    for piece, _ in learned:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok.model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    hf = _wrap(tok, bos="<s>", eos="</s>", unk="<unk>", add_bos=True)
    hf.save_pretrained(str(out_dir))
    return hf


def train_qwen2_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Qwen2 style byte-level BPE (NFC, :data:`QWEN2_SPLIT`, digits alone, no BOS); saved to ``out_dir``.

    Args:
        texts: Training corpus.
        vocab_size: Target vocabulary size (>= 257: 256 byte symbols + ``<|endoftext|>``).
        out_dir: Folder written with ``save_pretrained``.

    Raises:
        ValueError: ``vocab_size`` below 257.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use >= 257.")
    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    hf = _wrap(tok, bos=None, eos=eos, unk=None, add_bos=False)
    hf.save_pretrained(str(out_dir))
    return hf


def load_real_tokenizer(kind: str, out_dir: str | Path, cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A mistral-common tokenizer at its full vocabulary (pad = EOS where it has none); saved to ``out_dir``.

    Args:
        kind: One of :data:`REAL_KINDS`.
        out_dir: Folder written with ``save_pretrained``.
        cache_dir: Where THL's loader keeps its conversions (None: its default).

    Raises:
        ValueError: ``kind`` is not a real kind.
    """
    if kind not in REAL_KINDS:
        raise ValueError(f"tokenizer kind={kind!r} is not a real tokenizer; valid: {list(REAL_KINDS)}.")
    from mrl_lightning.thl.loader import load_tokenizer

    hf = load_tokenizer(REAL_KINDS[kind], cache_dir=cache_dir)
    if hf.pad_token is None:
        hf.pad_token = hf.eos_token
    hf.save_pretrained(str(out_dir))
    return hf


def train_char_level(texts: Iterable[str], out_dir: str | Path) -> PreTrainedTokenizerFast:
    """One token per training character, ``<0xHH>`` byte fallback for unseen ones.

    Args:
        texts: Training corpus; every character in it gets its own token.
        out_dir: Folder written with ``save_pretrained``.
    """
    specials = ["<unk>", "<s>", "</s>"]
    chars = sorted({c for t in texts for c in t})
    vocab = {s: i for i, s in enumerate(specials + _BYTE_PIECES)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"."), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    hf = _wrap(tok, bos="<s>", eos="</s>", unk="<unk>", add_bos=False)
    hf.save_pretrained(str(out_dir))
    return hf


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int, out_dir: str | Path,
                    cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Dispatch on ``kind`` (one of :data:`TOKENIZER_KINDS`); a real kind ignores ``texts`` and ``vocab_size``.

    Args:
        kind: The tokenizer kind.
        texts: Training corpus.
        vocab_size: Target size of a trained BPE (char_level and the real kinds have their own).
        out_dir: Folder written with ``save_pretrained``.
        cache_dir: THL's cache of converted real tokenizers (None: its default).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "byte_level_bpe":
        return train_byte_level_bpe(texts, vocab_size, out_dir)
    if kind == "sentencepiece_bpe":
        return train_sentencepiece_bpe(texts, vocab_size, out_dir)
    if kind == "char_level":
        return train_char_level(texts, out_dir)
    if kind == "qwen2_bpe":
        return train_qwen2_bpe(texts, vocab_size, out_dir)
    if kind in REAL_KINDS:
        return load_real_tokenizer(kind, out_dir, cache_dir)
    raise ValueError(f"tokenizer kind={kind!r} is unknown; valid: {list(TOKENIZER_KINDS)}")
