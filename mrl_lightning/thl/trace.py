"""Map per-token traces from a source segmentation onto a target one (docs/thl.md, "Mapping traces").

Given an :class:`~mrl_lightning.thl.align.Alignment`:

- log-probs (extensive, nats): each chunk's target tokens sum to exactly the chunk's
  source sum. Inside a chunk a source token's log-prob is split over the target
  tokens by overlapped bytes (``lp_s * |s ∩ t| / |s|``): the documented approximation;
  a chunk with one target token is exact. In a mismatch chunk (texts differ) each source
  token is split by target byte length. Log-probs of byte-less source tokens (EOS) go to
  the chunk's byte-less target tokens if any, else to its last target token.
- masks (True = counted): a target token is counted iff any source token of its
  chunk is (``any()``).
- per-token advantages (intensive): byte-weighted mean of the overlapped source values;
  a target token overlapping nothing (an appended EOS) takes the mean of its chunk.
- per-sequence advantage and terminal reward: broadcast / placed on the last target token.

All functions take plain sequences (or 1-D tensors, via ``tolist``) and return lists.
:func:`transfer_trace` does the whole route for one peer completion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from mrl_lightning.thl.align import Alignment, align_bytes
from mrl_lightning.thl.retokenize import Retokenized, retokenize
from mrl_lightning.thl.token_bytes import token_bytes


def _as_list(values: Any, n: int, name: str) -> list:
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) != n:
        raise ValueError(f"{name}: has {len(values)} entries but the alignment's source side has {n} tokens.")
    return values


def map_logprobs(source_logprobs: Sequence[float], alignment: Alignment) -> list[float]:
    """Per-token log-probs on the target side with exact chunk sums.

    Args:
        source_logprobs: ``[Ls]`` float, nats.
        alignment: Source -> target alignment.

    Returns:
        ``[Lt]`` float, nats; ``sum`` equals ``sum(source_logprobs)`` up to float
        rounding (unless a chunk has no target token; see :func:`conservation_error`).

    Raises:
        ValueError: If the length of ``source_logprobs`` is not ``Ls``.
    """
    lp = _as_list(source_logprobs, len(alignment.source_lengths), "source_logprobs")
    out = [0.0] * len(alignment.target_lengths)
    for t, s, w in zip(alignment.pair_target, alignment.pair_source, alignment.pair_weight):
        out[t] += lp[s] * w
    return out


def conservation_error(source_logprobs: Sequence[float], target_logprobs: Sequence[float]) -> float:
    """``|sum(target) - sum(source)|`` in nats, summed in float64 (``math.fsum``)."""
    src = source_logprobs.tolist() if hasattr(source_logprobs, "tolist") else source_logprobs
    tgt = target_logprobs.tolist() if hasattr(target_logprobs, "tolist") else target_logprobs
    return abs(math.fsum(tgt) - math.fsum(src))


def map_mask(source_mask: Sequence[bool], alignment: Alignment) -> list[bool]:
    """Target mask (True = counted): a target token counts iff any source token in its chunk does.

    Args:
        source_mask: ``[Ls]`` bool.
        alignment: Source -> target alignment.

    Returns:
        ``[Lt]`` bool; False for target tokens whose chunk has no source token.

    Raises:
        ValueError: If the length of ``source_mask`` is not ``Ls``.
    """
    mask = _as_list(source_mask, len(alignment.source_lengths), "source_mask")
    chunk_any = [False] * alignment.num_chunks
    for k, m in zip(alignment.source_chunk, mask):
        chunk_any[k] = chunk_any[k] or bool(m)
    return [chunk_any[k] for k in alignment.target_chunk]


def map_token_values(source_values: Sequence[float], alignment: Alignment) -> list[float]:
    """Intensive per-token values (e.g. per-token advantages): byte-weighted means.

    Args:
        source_values: ``[Ls]`` float.
        alignment: Source -> target alignment.

    Returns:
        ``[Lt]`` float; a target token overlapping no source bytes gets the mean over
        its chunk's source tokens (the sequence mean if the chunk has none; 0.0 if the
        source is empty).

    Raises:
        ValueError: If the length of ``source_values`` is not ``Ls``.
    """
    vals = _as_list(source_values, len(alignment.source_lengths), "source_values")
    n_t = len(alignment.target_lengths)
    num, den = [0.0] * n_t, [0.0] * n_t
    for t, s, o in zip(alignment.pair_target, alignment.pair_source, alignment.pair_overlap):
        num[t] += vals[s] * o
        den[t] += o
    chunk_sum, chunk_n = [0.0] * alignment.num_chunks, [0] * alignment.num_chunks
    for k, v in zip(alignment.source_chunk, vals):
        chunk_sum[k] += v
        chunk_n[k] += 1
    overall = sum(vals) / len(vals) if vals else 0.0
    out = []
    for t, k in enumerate(alignment.target_chunk):
        if den[t] > 0:
            out.append(num[t] / den[t])
        else:
            out.append(chunk_sum[k] / chunk_n[k] if chunk_n[k] else overall)
    return out


map_token_advantages = map_token_values


def map_sequence_advantage(advantage: float, alignment: Alignment) -> list[float]:
    """A per-sequence advantage broadcast to every target token: ``[Lt]`` float."""
    return [float(advantage)] * len(alignment.target_lengths)


def map_terminal_reward(reward: float, alignment: Alignment) -> list[float]:
    """A terminal reward placed on the last target token (zeros elsewhere): ``[Lt]`` float."""
    out = [0.0] * len(alignment.target_lengths)
    if out:
        out[-1] = float(reward)
    return out


@dataclass
class MappedTrace:
    """A peer completion in the receiver's tokens with its mapped sampling log-probs.

    Attributes:
        retokenized: The receiver's prompt and completion ids (see :func:`.retokenize`).
        alignment: Source completion tokens -> receiver completion tokens.
        source_logprobs: ``[Ls]`` float, nats: the source's sampling log-probs.
        logprobs: ``[Lt]`` float, nats: the source's sampling log-probs on the receiver's
            completion tokens (chunk sums exact).
        source_round_trip_ok: True if the source ids spell exactly the completion text.
        conservation_error: ``|sum(logprobs) - sum(source logprobs)|``, nats.
    """

    retokenized: Retokenized
    alignment: Alignment
    source_logprobs: list[float]
    logprobs: list[float]
    source_round_trip_ok: bool
    conservation_error: float

    @property
    def round_trip_ok(self) -> bool:
        """Both sides spell the completion text exactly."""
        return self.source_round_trip_ok and self.retokenized.round_trip_ok and self.alignment.bytes_match


def _cut_at_stop(pieces: list[bytes], text: bytes, stop: Sequence[str], include_stop: bool) -> bool:
    """Whether the producer's token ``pieces`` are ``text`` cut at one of its ``stop`` strings as the engines cut
    (docs/rollout.md, "Stop strings"): the pieces spell the text and then a tail, and the first stop ends inside
    the last piece, beginning where the text ends (``include_stop``: the text ends with it)."""
    spelled = b"".join(pieces)
    if not stop or not pieces or len(spelled) <= len(text) or not spelled.startswith(text):
        return False
    last_start = len(spelled) - len(pieces[-1])
    for s in stop:
        b = s.encode("utf-8")
        if not b:
            continue
        if include_stop:
            found = text.endswith(b) and last_start < len(text)
        else:
            found = spelled[len(text):].startswith(b) and last_start < len(text) + len(b)
        if found:
            return True
    return False


def _within(pieces: list[bytes], n: int) -> list[bytes]:
    """``pieces`` with every byte from offset ``n`` on removed (a piece wholly past it becomes empty)."""
    out, at = [], 0
    for piece in pieces:
        out.append(piece[: max(0, n - at)])
        at += len(piece)
    return out


def transfer_trace(
    source_tokenizer: Any,
    source_ids: Sequence[int],
    source_logprobs: Sequence[float],
    target_tokenizer: Any,
    prompt_text: str,
    completion_text: str,
    add_eos: bool = False,
    eos_id: int | None = None,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
) -> MappedTrace:
    """Retokenize a peer completion for the receiver and map its log-probs (docs/thl.md).

    Args:
        source_tokenizer: The producing policy's fast tokenizer.
        source_ids: ``[Ls]`` the producer's completion ids (EOS included if sampled).
        source_logprobs: ``[Ls]`` float, nats, the producer's sampling log-probs.
        target_tokenizer: The receiver's fast tokenizer.
        prompt_text: The prompt rendered with the receiver's template.
        completion_text: The completion text (as in ``RolloutRecord.completion_text``).
        add_eos: Append the receiver's end id (it receives the source's end log-prob if any).
        eos_id: That id (the receiver's end of turn, e.g. ``<|eot_id|>``); None = its EOS.
        stop: The producer's stop strings: a completion cut at one keeps the token that completed it
            while its text ends before it (docs/rollout.md, "Stop strings"), so its ids spelling the text
            and then that token's bytes past it is a round trip, not a failure; those bytes are dropped
            (a token wholly past the text then maps as an EOS does, one that also holds text bytes keeps
            its log-prob on them).
        include_stop_str_in_output: The producer's: its text ends with the stop string.

    Returns:
        A :class:`MappedTrace`.

    Raises:
        TypeError: If a tokenizer is not a fast tokenizer.
        ValueError: If ``source_logprobs`` and ``source_ids`` differ in length, or an id
            is not in the source vocabulary.
    """
    source_ids = source_ids.tolist() if hasattr(source_ids, "tolist") else list(source_ids)
    retok = retokenize(target_tokenizer, prompt_text, completion_text, add_eos=add_eos, eos_id=eos_id)
    src_pieces = token_bytes(source_tokenizer, source_ids)
    text_bytes = completion_text.encode("utf-8", "surrogateescape")
    spelled = b"".join(src_pieces)
    cut = spelled != text_bytes and _cut_at_stop(src_pieces, text_bytes, stop, include_stop_str_in_output)
    if cut:  # the stop's bytes past the text are the producer's "end": its tokens then map as an EOS does
        src_pieces = _within(src_pieces, len(text_bytes))
    tgt_pieces = token_bytes(target_tokenizer, retok.completion_ids)
    alignment = align_bytes(src_pieces, tgt_pieces)
    lps = _as_list(source_logprobs, len(source_ids), "source_logprobs")
    mapped = map_logprobs(lps, alignment)
    source_ok = spelled == text_bytes or cut
    return MappedTrace(retok, alignment, [float(x) for x in lps], mapped, source_ok, conservation_error(lps, mapped))
