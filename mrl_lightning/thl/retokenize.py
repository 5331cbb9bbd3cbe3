"""Retokenize a peer's completion into a target tokenizer's own tokens (docs/thl.md).

The receiver's training sequence is ``prompt_ids + completion_ids``:

- ``prompt_ids`` is ``tokenizer(prompt_text)["input_ids"]`` (BOS and all), except that a
  prompt text that already starts with the BOS token (a chat template that writes
  ``{{ bos_token }}``) keeps one BOS, not the two a plain encode gives
  (:func:`encode_prompt_text`): the ids a chat policy's own rollouts start with.
- ``completion_ids`` is the target tokenizer's encoding of the completion text *alone*,
  so no merge crosses the prompt/completion boundary, with three departures from
  ``tokenizer(completion_text)``:

  1. no dummy prefix (SentencePiece ``▁`` prepended to a text start, byte-level
     ``add_prefix_space``): the completion continues a prompt, it does not start a text;
  2. special-token strings inside the text (``"</s>"``, ``"<|endoftext|>"``) are
     encoded as ordinary text, never as control tokens;
  3. no BOS / EOS from the post-processor (EOS is appended only on request).

Every result is verified on bytes: the tokens' bytes (:mod:`.token_bytes`) must equal
the completion's UTF-8 bytes. If the tokenizer's own encoder cannot reproduce the text
(e.g. SentencePiece maps a literal ``▁`` in the text to a space), the completion is
re-encoded by greedy longest match over the vocabulary's byte strings, which is exact
whenever the vocabulary covers every byte (byte-level BPE, byte fallback, Tekken).
If even that fails (a character-level vocabulary without the character), the native
ids are returned with ``round_trip_ok=False`` and THL's residual metrics count it.

Cut characters: a generation stopped inside a multi-byte character leaves either
``"\\ufffd"`` (``bytes.decode(errors="replace")``, what HF ``decode`` gives) or
lone surrogates ``\\udc80-\\udcff`` (``errors="surrogateescape"``, bytes kept) at the
end of the text. Both set ``invalid_utf8_tail``; escaped bytes are encoded as single
byte tokens so that the target holds exactly the source's bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from tokenizers import Tokenizer

from mrl_lightning.thl.token_bytes import _CACHE_ATTR as _TABLE_ATTR
from mrl_lightning.thl.token_bytes import (
    ByteTable,
    _walk,
    backend_spec,
    build_byte_table,
)

_STATE_ATTR = "_mrl_thl_retok_state"
_ESCAPED = re.compile("[\udc80-\udcff]+")
_ANCHORED = ("\\A", "^")
_PROMPT_CACHE_SIZE = 4096  # G completions share one prompt: encode it once


@dataclass
class Retokenized:
    """A prompt and completion in one tokenizer's ids.

    Attributes:
        prompt_ids: ``[P]`` ids of the prompt (:func:`encode_prompt_text`: the plain
            encoding, with one BOS where the text brings its own).
        completion_ids: ``[L]`` ids covering exactly the completion's characters, plus
            the EOS id at the end iff ``add_eos``.
        completion_offsets: ``[L]`` (start, end) character offsets into the completion
            text; byte pieces of one character all get that character's span;
            ``(0, 0)`` for an appended EOS.
        invalid_utf8_tail: True if the completion ends inside a multi-byte character
            (trailing ``"\\ufffd"`` or surrogate-escaped bytes).
        round_trip_ok: True if the completion tokens' bytes equal the text's bytes.
        used_fallback: True if the tokenizer's own encoder could not reproduce the text
            and the greedy byte-string encoding was used instead.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_offsets: list[tuple[int, int]]
    invalid_utf8_tail: bool
    round_trip_ok: bool = True
    used_fallback: bool = False


@dataclass
class _State:
    table: ByteTable
    encoder: Tokenizer
    vocab_size: int
    prompts: dict[str, list[int]] = field(default_factory=dict)


def _strip_prefix_normalizer(node: dict | None) -> dict | None:
    """Drop normalizers that only add a dummy prefix (Prepend, anchored Replace)."""
    if node is None:
        return None

    def is_prefix(d: dict) -> bool:
        pattern = d.get("pattern", {}) if d.get("type") == "Replace" else {}
        return d.get("type") == "Prepend" or str(pattern.get("Regex", "")).startswith(_ANCHORED)

    if node.get("type") == "Sequence":
        kept = [n for n in node.get("normalizers", []) if not is_prefix(n)]
        return {**node, "normalizers": kept} if kept else None
    return None if is_prefix(node) else node


def _build_state(tokenizer: Any) -> _State:
    spec = backend_spec(tokenizer)
    table = getattr(tokenizer, _TABLE_ATTR, None)
    if table is None:
        table = build_byte_table(tokenizer, spec)
        setattr(tokenizer, _TABLE_ATTR, table)
    spec["normalizer"] = _strip_prefix_normalizer(spec.get("normalizer"))
    spec["post_processor"] = None
    spec["truncation"] = None
    spec["padding"] = None
    for node in _walk(spec.get("pre_tokenizer")):
        if node.get("type") == "Metaspace":
            node["prepend_scheme"] = "never"
            node.pop("add_prefix_space", None)
        elif node.get("type") == "ByteLevel":
            node["add_prefix_space"] = False
    encoder = Tokenizer.from_str(json.dumps(spec))
    encoder.encode_special_tokens = True
    return _State(table, encoder, len(tokenizer))


def prepare(tokenizer: Any, encoder: bool = True) -> None:
    """Build now what THL builds for ``tokenizer`` on its first use: its byte table and its completion encoder.

    One-off and slow for a large vocabulary (Gemma 3's 262,144 ids: about 2 s for the byte table and
    3 s more for the encoder on a CPU core, most of it the tokenizer's JSON description written,
    parsed and read back): the probes call it in their ``setup``, so the first step that
    retokenizes text does not pay it (docs/thl.md, "Where THL is used").

    Args:
        tokenizer: A Hugging Face fast tokenizer.
        encoder: Also the encoder of completions (a tokenizer text is retokenized into); False =
            the byte table only (a tokenizer whose ids are mapped from, a producer's).
    """
    if encoder:
        _state(tokenizer)
    elif getattr(tokenizer, _TABLE_ATTR, None) is None:
        setattr(tokenizer, _TABLE_ATTR, build_byte_table(tokenizer, backend_spec(tokenizer)))


def _state(tokenizer: Any) -> _State:
    state = getattr(tokenizer, _STATE_ATTR, None)
    if state is None:
        state = _build_state(tokenizer)
        setattr(tokenizer, _STATE_ATTR, state)
    return state


def _greedy(data: bytes, table: ByteTable) -> list[int] | None:
    """Longest-match encoding of ``data`` over the vocabulary's byte strings."""
    by_bytes, max_len = table.lookup()
    out: list[int] = []
    i, n = 0, len(data)
    while i < n:
        for width in range(min(max_len, n - i), 0, -1):
            tid = by_bytes.get(data[i : i + width])
            if tid is not None:
                out.append(tid)
                i += width
                break
        else:
            return None
    return out


def _encode_run(text: str, state: _State) -> tuple[list[int], bool, bool]:
    """Encode valid text; return (ids, exact, used_fallback)."""
    if not text:
        return [], True, False
    ids = state.encoder.encode(text, add_special_tokens=False).ids
    pieces, special = state.table.piece_bytes, state.table.special_ids
    data = text.encode("utf-8")
    if b"".join([pieces[i] for i in ids]) == data and not special.intersection(ids):
        return ids, True, False
    greedy = _greedy(data, state.table)
    if greedy is not None:
        return greedy, True, True
    return ids, False, False


def _encode_escaped(escaped: str, state: _State) -> tuple[list[int], bool]:
    """Encode surrogate-escaped raw bytes as single-byte tokens."""
    byte_ids = state.table.byte_ids
    raw = escaped.encode("utf-8", "surrogateescape")
    if all(b in byte_ids for b in raw):
        return [byte_ids[b] for b in raw], True
    return [], False


def _text_bytes(text: str, field: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"{field}: contains the lone surrogate {text[err.start]!r} at index {err.start}, which is neither "
                "UTF-8 text nor a surrogate-escaped byte. Decode generated bytes with errors='replace' or "
                "errors='surrogateescape'."
            ) from None


def char_offsets(text: str, lengths: list[int]) -> list[tuple[int, int]]:
    """Character spans of consecutive byte pieces of ``text``.

    Args:
        text: The text (surrogate-escaped bytes count one byte each).
        lengths: ``[L]`` byte length of each piece, in order.

    Returns:
        ``[L]`` (start, end) character offsets; a piece inside one character gets that
        character's span; a zero-length piece gets ``(c, c)`` (``c == len(text)`` at the
        end of the text); spans are clipped to ``len(text)``.
    """
    ends = list(accumulate(lengths))
    starts = [e - n for e, n in zip(ends, lengths)]
    n_chars = len(text)
    if text.isascii():
        if not ends or ends[-1] <= n_chars:
            return list(zip(starts, ends))
        return [(min(s, n_chars), min(e, n_chars)) for s, e in zip(starts, ends)]
    import numpy as np  # only non-ASCII text needs it

    # Bytes per character from its code point (vectorized; a per-character encode is ~10x slower):
    # 1 below U+0080, 2 below U+0800, 3 below U+10000, else 4; a surrogate-escaped byte is 1.
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    nbytes = 1 + (cps >= 0x80) + (cps >= 0x800) + (cps >= 0x10000) - 2 * ((cps >= 0xDC80) & (cps <= 0xDCFF))
    char_starts = np.zeros(n_chars + 1, dtype=np.int64)  # the last: the end of the text, as a character start
    np.cumsum(nbytes, out=char_starts[1:])
    c0 = (np.searchsorted(char_starts, starts, side="right") - 1).tolist()
    c1 = np.minimum(np.searchsorted(char_starts, ends, side="left"), n_chars).tolist()
    return [(a, a) if e == s else (a, b) for a, b, s, e in zip(c0, c1, starts, ends)]


def encode_completion(tokenizer: Any, completion_text: str) -> Retokenized:
    """Encode a completion alone (no prompt ids, no EOS); see :func:`retokenize`.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer or the text is not a str.
        ValueError: If the text holds lone surrogates that are not escaped bytes.
    """
    if not isinstance(completion_text, str):
        raise TypeError(f"completion_text: expected str, got {type(completion_text).__name__}.")
    state = _state(tokenizer)
    _text_bytes(completion_text, "completion_text")
    ids: list[int] = []
    exact, fallback = True, False
    if completion_text.isascii() or not _ESCAPED.search(completion_text):
        ids, exact, fallback = _encode_run(completion_text, state)
    else:
        pos = 0
        for match in _ESCAPED.finditer(completion_text):
            run_ids, run_exact, run_fb = _encode_run(completion_text[pos : match.start()], state)
            esc_ids, esc_exact = _encode_escaped(match.group(), state)
            ids += run_ids + esc_ids
            exact, fallback = exact and run_exact and esc_exact, fallback or run_fb
            pos = match.end()
        run_ids, run_exact, run_fb = _encode_run(completion_text[pos:], state)
        ids += run_ids
        exact, fallback = exact and run_exact, fallback or run_fb
    pieces = state.table.piece_bytes
    offsets = char_offsets(completion_text, [len(pieces[i]) for i in ids])
    tail = completion_text.endswith("\ufffd") or bool(completion_text) and "\udc80" <= completion_text[-1] <= "\udcff"
    return Retokenized([], ids, offsets, tail, exact, fallback)


def encode_prompt_text(tokenizer: Any, prompt_text: str) -> list[int]:
    """``tokenizer(prompt_text)["input_ids"]`` with at most one leading BOS.

    A rendered chat prompt may begin with the BOS token's text (templates that write
    ``{{ bos_token }}``); a tokenizer that also adds BOS then encodes two. The extra one is
    dropped, so the ids equal :func:`mrl_lightning.model.chat.encode_rendered`'s (untruncated) for
    a chat prompt and the plain encoding for any other prompt.

    Args:
        prompt_text: A rendered prompt.

    Returns:
        ``[P]`` token ids.
    """
    ids = list(tokenizer(prompt_text)["input_ids"])
    bos, bos_text = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
    if bos is not None and bos_text and ids[:2] == [bos, bos] and prompt_text.startswith(bos_text):
        ids = ids[1:]
    return ids


def retokenize(tokenizer: Any, prompt_text: str, completion_text: str, add_eos: bool = False,
               eos_id: int | None = None) -> Retokenized:
    """The target tokenizer's own ids for a prompt and a (peer's) completion (docs/thl.md).

    Args:
        tokenizer: Target Hugging Face fast tokenizer.
        prompt_text: The prompt as rendered for the target (template applied).
        completion_text: The completion text; may end in a cut character (see module doc).
        add_eos: Append the end id to ``completion_ids``.
        eos_id: The id to append (what the receiver's own completions end with, e.g. a chat
            template's end-of-turn token); None = ``tokenizer.eos_token_id``.

    Returns:
        A :class:`Retokenized`; ``decode_completion(tokenizer, completion_ids)`` equals
        ``completion_text`` whenever ``round_trip_ok``.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer or a text is not a str.
        ValueError: If ``add_eos`` and the tokenizer has no EOS token, or the completion
            holds lone surrogates that are not escaped bytes.
    """
    if not isinstance(prompt_text, str):
        raise TypeError(f"prompt_text: expected str, got {type(prompt_text).__name__}.")
    out = encode_completion(tokenizer, completion_text)
    cache = _state(tokenizer).prompts
    prompt_ids = cache.get(prompt_text)
    if prompt_ids is None:
        if len(cache) >= _PROMPT_CACHE_SIZE:
            cache.clear()
        prompt_ids = cache[prompt_text] = encode_prompt_text(tokenizer, prompt_text)
    out.prompt_ids = list(prompt_ids)
    if add_eos:
        eos = eos_id if eos_id is not None else getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError(
                f"add_eos=True but {type(tokenizer).__name__} has no eos_token; set tokenizer.eos_token or pass "
                "add_eos=False."
            )
        out.completion_ids.append(eos)
        out.completion_offsets.append((0, 0))
    return out


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Short stable hash of a tokenizer's vocabulary, merges, normalizer, pre-tokenizer,
    decoder and added tokens (``RolloutRecord.tokenizer_fingerprint``, docs/see.md).

    Two tokenizers with the same fingerprint segment and decode every text alike.

    Returns:
        16 lowercase hex characters.

    Raises:
        TypeError: If ``tokenizer`` is not a fast tokenizer.
    """
    cached = getattr(tokenizer, "_mrl_thl_fingerprint", None)
    if cached is not None and cached[0] == len(tokenizer):
        return cached[1]
    spec = backend_spec(tokenizer)
    keys = ("model", "normalizer", "pre_tokenizer", "decoder", "added_tokens")
    blob = json.dumps({k: spec.get(k) for k in keys}, sort_keys=True, ensure_ascii=False)
    digest = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
    setattr(tokenizer, "_mrl_thl_fingerprint", (len(tokenizer), digest))
    return digest
