"""Exact bytes of every token id, for any Hugging Face fast tokenizer (docs/thl.md).

THL aligns token traces on bytes, never on characters: two tokenizers can both cut
inside one multi-byte character (docs/thl.md). This module recovers, for
each id of a tokenizer, the UTF-8 bytes that the token stands for *inside* a
completion (no dummy prefix), from the tokenizer's own serialized description:

- byte-level BPE (GPT-2, Tekken converted by transformers): every character of the
  piece is one byte under the GPT-2 byte-to-unicode table;
- SentencePiece / Metaspace (Mistral v1 / v3, Llama): ``▁`` stands for a space and
  ``<0xHH>`` byte-fallback pieces stand for the single byte ``0xHH``;
- anything else (character-level, word-level): the piece's UTF-8 bytes.

Special tokens (BOS, EOS, ``[INST]`` ...) stand for no text: their bytes are ``b""``.
Non-special added tokens stand for their literal content.

The table is built once per tokenizer (about 0.5 s for 131k ids) and cached on the
tokenizer object; it is rebuilt when an id beyond it is looked up (tokens added later).
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

_CACHE_ATTR = "_mrl_thl_byte_table"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "\u2581"


def gpt2_byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-character table of byte-level BPE (GPT-2).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order,
    to the code points 256, 257, ... so that no piece contains whitespace or control
    characters.

    Returns:
        Mapping of all 256 byte values to one-character strings.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {ch: b for b, ch in gpt2_byte_to_unicode().items()}


@dataclass
class ByteTable:
    """Per-id bytes of one tokenizer.

    Attributes:
        scheme: ``"byte_level"``, ``"metaspace"`` or ``"plain"`` (how pieces map to bytes).
        piece_bytes: ``[V]`` bytes each id stands for inside a completion (``b""`` for
            special tokens).
        special_ids: Ids of special (control) tokens.
        byte_ids: byte value -> id of a token standing for exactly that one byte, when
            the vocabulary has one (byte-level pieces or ``<0xHH>`` fallback pieces).
        dummy_prefix: True if encoding a full text prepends one space (SentencePiece
            ``add_dummy_prefix``), which the decoder strips again.
        vocab_size: ``len(tokenizer)`` when the table was built (cache key).
    """

    scheme: str
    piece_bytes: list[bytes]
    special_ids: frozenset[int]
    byte_ids: dict[int, int]
    dummy_prefix: bool
    vocab_size: int
    _by_bytes: dict[bytes, int] | None = field(default=None, repr=False)
    _max_len: int = field(default=0, repr=False)

    def lookup(self) -> tuple[dict[bytes, int], int]:
        """Bytes -> id for non-special tokens (regular pieces win over byte pieces).

        Returns:
            The mapping and the longest key length in bytes.
        """
        if self._by_bytes is None:
            byte_piece_ids = set(self.byte_ids.values())
            by_bytes = {bytes([value]): tid for value, tid in self.byte_ids.items()}
            regular: set[bytes] = set()
            for tid, piece in enumerate(self.piece_bytes):
                if piece and tid not in self.special_ids and tid not in byte_piece_ids and piece not in regular:
                    by_bytes[piece] = tid
                    regular.add(piece)
            self._by_bytes = by_bytes
            self._max_len = max((len(k) for k in by_bytes), default=0)
        return self._by_bytes, self._max_len


def _walk(node: Any):
    """Yield every dict inside a serialized tokenizer component (depth first)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _detect_scheme(spec: dict) -> tuple[str, bool]:
    """Return (scheme, dummy_prefix) from a tokenizer.json-style dict."""
    types = {d.get("type") for d in _walk(spec.get("decoder"))}
    pre = list(_walk(spec.get("pre_tokenizer")))
    norm = list(_walk(spec.get("normalizer")))
    if "ByteLevel" in types:
        return "byte_level", any(d.get("type") == "ByteLevel" and d.get("add_prefix_space") for d in pre)
    metaspace_pre = [d for d in pre if d.get("type") == "Metaspace"]
    replaces_marker = any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == _METASPACE
        for d in _walk(spec.get("decoder"))
    )
    if "Metaspace" in types or metaspace_pre or replaces_marker:
        prefix = any(
            d.get("prepend_scheme", "always") in ("always", "first") or d.get("add_prefix_space") for d in metaspace_pre
        )
        prefix = prefix or any(d.get("type") == "Prepend" for d in norm)
        return "metaspace", prefix
    return "plain", False


def build_byte_table(tokenizer: Any, spec: dict | None = None) -> ByteTable:
    """Build the per-id byte table of a fast tokenizer (uncached; see :func:`byte_table`).

    Args:
        tokenizer: A ``transformers`` fast tokenizer (has ``backend_tokenizer``).
        spec: ``json.loads(tokenizer.backend_tokenizer.to_str())`` when the caller has
            it already (saves a second parse of a large vocabulary).

    Returns:
        The :class:`ByteTable`.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer (no ``backend_tokenizer``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"tokenizer: got {type(tokenizer).__name__}, which has no backend_tokenizer; THL needs a "
            "Hugging Face fast tokenizer. Load it with AutoTokenizer.from_pretrained(..., use_fast=True) "
            "or mrl_lightning.thl.load_tokenizer."
        )
    spec = json.loads(backend.to_str()) if spec is None else spec
    scheme, dummy_prefix = _detect_scheme(spec)
    byte_fallback = bool(spec.get("model", {}).get("byte_fallback"))
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    special_ids = frozenset(i for i, t in added.items() if t.get("special"))
    pieces: list[bytes] = [b""] * size
    byte_ids: dict[int, int] = {}
    for piece, tid in vocab.items():
        if tid in special_ids:
            continue
        if tid in added:
            pieces[tid] = added[tid]["content"].encode("utf-8")
            continue
        if scheme == "byte_level":
            try:
                pieces[tid] = bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
            except KeyError:
                pieces[tid] = piece.encode("utf-8")
            if len(pieces[tid]) == 1:
                byte_ids.setdefault(pieces[tid][0], tid)
            continue
        match = _BYTE_PIECE.match(piece) if byte_fallback or scheme == "metaspace" else None
        if match:
            value = int(match.group(1), 16)
            pieces[tid] = bytes([value])
            byte_ids[value] = tid
        elif scheme == "metaspace":
            pieces[tid] = piece.replace(_METASPACE, " ").encode("utf-8")
        else:
            pieces[tid] = piece.encode("utf-8")
    return ByteTable(scheme, pieces, special_ids, byte_ids, dummy_prefix, len(tokenizer))


def backend_spec(tokenizer: Any) -> dict:
    """The tokenizer's serialized ``tokenizer.json`` content as a dict.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"tokenizer: got {type(tokenizer).__name__}, which has no backend_tokenizer; THL needs a "
            "Hugging Face fast tokenizer. Load it with mrl_lightning.thl.load_tokenizer."
        )
    return json.loads(backend.to_str())


def byte_table(tokenizer: Any) -> ByteTable:
    """The cached :class:`ByteTable` of ``tokenizer`` (built on first use).

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer.
    """
    table = getattr(tokenizer, _CACHE_ATTR, None)
    if table is None:
        table = build_byte_table(tokenizer)
        setattr(tokenizer, _CACHE_ATTR, table)
    return table


def token_bytes(tokenizer: Any, ids: Sequence[int], strip_dummy_prefix: bool = False) -> list[bytes]:
    """Bytes of each token in ``ids`` (``b""`` for special tokens).

    Args:
        tokenizer: A fast tokenizer.
        ids: ``[L]`` int token ids (a completion: no dummy prefix expected).
        strip_dummy_prefix: Set when ``ids`` encode a *full* text from its start
            (e.g. ``tokenizer(text)["input_ids"]``): one leading space that the
            tokenizer's dummy prefix added is removed from the first text token.

    Returns:
        ``[L]`` bytes objects; ``b"".join`` of them is the text's UTF-8 encoding.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer.
        ValueError: If an id is outside the vocabulary.
    """
    table = byte_table(tokenizer)
    ids = [operator.index(i) for i in ids] if not isinstance(ids, list) else ids
    if ids and (min(ids) < 0 or max(ids) >= len(table.piece_bytes)):
        setattr(tokenizer, _CACHE_ATTR, None)  # tokens may have been added since the table was built
        table = byte_table(tokenizer)
        bad = [i for i in ids if not 0 <= i < len(table.piece_bytes)]
        if bad:
            raise ValueError(
                f"ids: {bad[:5]} are not ids of this tokenizer (vocabulary size {len(table.piece_bytes)}); "
                "pass ids produced by this same tokenizer."
            )
    pieces = table.piece_bytes
    out = [pieces[i] for i in ids]
    if strip_dummy_prefix and table.dummy_prefix:
        for k, piece in enumerate(out):
            if piece:
                if piece.startswith(b" "):
                    out[k] = piece[1:]
                break
    return out


def decode_completion(tokenizer: Any, ids: Sequence[int], errors: str = "strict") -> str:
    """Exact text of completion token ids (special tokens such as EOS contribute nothing).

    Unlike ``tokenizer.decode``, keeps a leading space on SentencePiece tokenizers,
    whose decoder strips the first space as if it were the dummy prefix.

    Args:
        tokenizer: A fast tokenizer.
        ids: ``[L]`` completion token ids.
        errors: UTF-8 error handler: ``"strict"``, ``"replace"`` (what HF decode does
            with a cut character) or ``"surrogateescape"`` (keeps cut bytes recoverable).

    Returns:
        The decoded text.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer.
        ValueError: If an id is outside the vocabulary.
        UnicodeDecodeError: With ``errors="strict"`` when the bytes are not valid UTF-8.
    """
    return b"".join(token_bytes(tokenizer, ids)).decode("utf-8", errors=errors)
