"""Build a Hugging Face fast tokenizer from a SentencePiece BPE model file (docs/thl.md, section 7).

The Mistral v1 / v3 tokenizers ship as SentencePiece ``.model`` files. ``transformers``
converts such files with its own converter, and that converter has changed between
releases: 5.16-5.23 and 5.24 give different ids for the same text (the dummy prefix
before a leading space: ``[1, 6312, 28709]`` against ``[1, 28705, 6312, 28709]``). This
module builds the ``tokenizers`` pipeline itself from the model's protobuf, so the result
depends only on the file and on the ``tokenizers`` library, and it is checked against
SentencePiece's own encoder when it is built (:func:`sentencepiece_mismatches`).

How SentencePiece BPE encodes a text, and the piece of the pipeline that does the same:

- Normalizer ``identity`` with ``add_dummy_prefix`` and ``escape_whitespaces``: one ``▁``
  in front of every non-empty text, even one that already starts with a space, and every
  space becomes ``▁`` -> ``Prepend("▁")`` then ``Replace(" ", "▁")``.
- User-defined pieces (v3's ``[REFERENCE_DOC_n]``) are matched whole in the normalized
  text, longest first, and never merged with a neighbour -> a ``Split`` pre-tokenizer that
  isolates them, and ``ignore_merges`` so that an isolated piece maps to its own id (every
  ordinary piece also maps to itself under the merges: checked at build time).
- BPE: repeatedly merge the adjacent pair whose joined piece has the highest score, the
  leftmost pair on a tie -> ``models.BPE`` with one merge ``(left, right)`` per way of
  splitting each piece into two pieces, ranked by the joined piece's score.
- Ties: the whitespace-only pieces (``▁▁``, ..., ``▁`` x 16) all score -1e9, so a run of
  spaces is merged leftmost-first, which gives runs of 16 from the left and then the
  remainder (15, which has no piece, as 14 + 1). A static merge rank cannot say
  "leftmost", so those merges are ranked to give the same result: doubling (1+1, 2+2, 4+4,
  8+8) first, then the binary remainder joined from the left.
- Byte fallback: a character with no piece becomes its UTF-8 bytes ``<0xHH>``.
- Control pieces (``<unk>``, ``<s>``, ``</s>``, v3's ``[INST]``, ...) are special tokens.
  Departure from SentencePiece: text that spells one of them is read as that token, the
  Hugging Face convention that chat templates rely on (``model/chat.py``); each stretch of text
  between such tokens is then encoded as SentencePiece encodes it on its own.
- Decoder: ``▁`` -> space, bytes fused, one leading space stripped.

Only what the shipped Mistral files use is supported; any other setting raises with the
field and its value (:func:`unsupported_settings`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_SPACE = "\u2581"
# SentencePiece piece types (sentencepiece_model.proto, ModelProto.SentencePiece.Type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE = 2
_MODEL_TYPES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}

SELF_CHECK_TEXTS = (
    "", "hello", " hello", "  two spaces", " 68", "The answer is 42.", "x = 1\n", "\tTab\tand\nnewline\n",
    "trailing   ", "\u4e2d\u6587 and \U0001F600 and e\u0301", "caf\u00e9 na\u00efve \u00fcber", "12345 + 67890 = 80235",
    "def add(x, y):\n    return x + y\n", "====----****____....", "aaaaaaaa bbbbbbbbbb", "\u2581 marker \u2581\u2581",
    "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627", "\U00010348\u200d\ufeff\x00", "a\r\nb",
    *(" " * n + "x" + " " * n for n in range(1, 40)),
)


def _load_proto(model_file: str | Path) -> Any:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    return proto


def unsupported_settings(proto: Any) -> list[str]:
    """Settings of a SentencePiece model that :func:`build_backend` cannot reproduce.

    Args:
        proto: A parsed ``sentencepiece_model_pb2.ModelProto``.

    Returns:
        One line per problem, naming the field, its value and what is supported (empty
        when the model is supported).
    """
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type != _BPE:
        problems.append(f"trainer_spec.model_type={_MODEL_TYPES.get(trainer.model_type, trainer.model_type)}; "
                        "supported: BPE")
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        problems.append(f"normalizer_spec.name={norm.name!r} with a {len(norm.precompiled_charsmap)}-byte "
                        "charsmap; supported: 'identity' (no Unicode normalization)")
    if norm.remove_extra_whitespaces:
        problems.append("normalizer_spec.remove_extra_whitespaces=True; supported: False")
    if not norm.escape_whitespaces:
        problems.append("normalizer_spec.escape_whitespaces=False; supported: True")
    if trainer.treat_whitespace_as_suffix:
        problems.append("trainer_spec.treat_whitespace_as_suffix=True; supported: False")
    unused = sum(p.type == _UNUSED for p in proto.pieces)
    if unused:
        problems.append(f"{unused} pieces of type UNUSED; supported: none")
    if not 0 <= trainer.unk_id < len(proto.pieces):
        problems.append(f"trainer_spec.unk_id={trainer.unk_id}; supported: the id of a piece")
    return problems


def _merge_rank(score: float, piece_id: int, left: str, right: str) -> tuple:
    """Sort key of the merge ``left + right``: higher joined score first (see the module doc)."""
    if set(left + right) != {_SPACE}:
        return (-score, 0, piece_id, len(left))
    a, b = len(left), len(right)
    if a == b and a & (a - 1) == 0:  # doubling: 1+1, 2+2, 4+4, ...
        return (-score, 0, a, 0)
    if b & (b - 1) == 0 and b < (a & -a):  # a left run taking the next binary remainder
        return (-score, 1, -a, -b)
    return (-score, 2, piece_id, a)


def _merges(proto: Any) -> list[tuple[str, str]]:
    normal = {p.piece: p.score for p in proto.pieces if p.type == _NORMAL}
    ranked = []
    for piece_id, p in enumerate(proto.pieces):
        if p.type != _NORMAL:
            continue
        text = p.piece
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in normal and right in normal:
                ranked.append((_merge_rank(p.score, piece_id, left, right), left, right))
    ranked.sort(key=lambda item: item[0])
    return [(left, right) for _, left, right in ranked]


def build_backend(model_file: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` that encodes and decodes as the SentencePiece model does.

    Args:
        model_file: A SentencePiece BPE ``.model`` file (any file name).

    Returns:
        A ``tokenizers.Tokenizer`` with no post-processor (no BOS added).

    Raises:
        ValueError: If the model uses a setting listed by :func:`unsupported_settings`, or
            if one of its ordinary pieces is not reachable through its own merges (then
            isolated user-defined pieces cannot be given their ids).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = _load_proto(model_file)
    problems = unsupported_settings(proto)
    if problems:
        raise ValueError(
            f"SentencePiece model {model_file}: cannot build a fast tokenizer for it:\n  - " + "\n  - ".join(problems)
            + "\nPut a tokenizer.json for it in a folder and pass the folder instead."
        )
    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    user_defined = [p.piece for p in pieces if p.type == _USER_DEFINED]
    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=_merges(proto), unk_token=pieces[proto.trainer_spec.unk_id].piece,
        byte_fallback=proto.trainer_spec.byte_fallback, fuse_unk=True, ignore_merges=bool(user_defined),
    ))
    steps = [normalizers.Prepend(_SPACE)] if proto.normalizer_spec.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    if user_defined:
        longest_first = sorted(user_defined, key=len, reverse=True)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(map(re.escape, longest_first))), behavior="isolated")
        unreachable = [p.piece for p in pieces if p.type == _NORMAL
                       and [t.value for t in tok.model.tokenize(p.piece)] != [p.piece]]
        if unreachable:
            raise ValueError(
                f"SentencePiece model {model_file}: {len(unreachable)} pieces (e.g. {unreachable[:3]}) are not "
                "produced by their own merges, so its user-defined pieces cannot be matched exactly. Put a "
                "tokenizer.json for it in a folder and pass the folder instead."
            )
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in pieces if p.type in (_CONTROL, _UNKNOWN)])
    return tok


def sentencepiece_to_fast(model_file: str | Path) -> Any:
    """A ``transformers`` fast tokenizer for a SentencePiece BPE model, without transformers' converter.

    Args:
        model_file: A SentencePiece BPE ``.model`` file.

    Returns:
        A ``PreTrainedTokenizerFast`` with the model's ``<s>`` / ``</s>`` / ``<unk>`` set
        (it adds no BOS; ``loader.py`` adds that).

    Raises:
        ValueError: As :func:`build_backend`.
    """
    from transformers import PreTrainedTokenizerFast

    proto = _load_proto(model_file)
    backend = build_backend(model_file)
    trainer = proto.trainer_spec

    def piece(index: int) -> str | None:
        return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=piece(trainer.bos_id), eos_token=piece(trainer.eos_id),
        unk_token=piece(trainer.unk_id), pad_token=piece(trainer.pad_id), clean_up_tokenization_spaces=False,
    )


def sentencepiece_mismatches(tokenizer: Any, model_file: str | Path,
                             texts: tuple[str, ...] = SELF_CHECK_TEXTS) -> list[str]:
    """Texts whose ids differ between ``tokenizer`` and SentencePiece's own encoder.

    Args:
        tokenizer: A ``transformers`` fast tokenizer or a ``tokenizers.Tokenizer``.
        model_file: The SentencePiece model it was built from.
        texts: Texts to compare (none should spell a control token such as ``<s>``: those
            are read as special tokens on purpose, see the module doc).

    Returns:
        The texts that differ, in order (empty when all agree). Ids are compared without
        BOS / EOS.
    """
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return [text for text in texts if backend.encode(text, add_special_tokens=False).ids != reference.encode(text)]
