"""Stop strings, cut exactly as vLLM cuts them (docs/rollout.md, "Stop strings").

A policy's ``stop`` strings (vLLM's ``SamplingParams.stop``; e.g. ``"\\n"`` for a base model,
as evaluation harnesses end an answer) end a completion where its *text* contains one. vLLM
0.32 does it in its output processor, after sampling, on the detokenized text
(``vllm/v1/engine/detokenizer.py``: ``BaseIncrementalDetokenizer.update`` and
``check_stop_strings``; ``output_processor.py``: ``_trim_surplus_tokens``):

1. each new token's text is appended to the completion's text (a token that ends the request
   as a stop *token*, e.g. EOS, adds none); special tokens add none (``skip_special_tokens``);
2. the stop strings are searched in the text, only where a match can end inside the new text
   (``output_text.find(stop, 1 - new_char_count - len(stop))``); when several match, the one
   that *ends* first wins, ties by list order;
3. on a match the request finishes with ``finish_reason="stop"`` and ``stop_reason`` the
   matched string, also when that token was the last one ``max_tokens`` allowed; the text is
   cut before the stop string (``include_stop_str_in_output=False``, the default) or after it;
4. the token ids keep every token up to and including the one whose text completed the stop
   string, and the log-probs the same tokens: text the same token holds after the stop string
   is cut from the text but its token stays.

:func:`scan_completion` replays those rules on sampled ids; both engines use it, so the Hugging
Face engine cuts where vLLM would and the vLLM engine cuts identically in server mode too, where
the reply carries no text and no finish reason. A token's text is its bytes
(:func:`~mrl_lightning.thl.token_bytes`) through an incremental UTF-8 decoder, which, like
the ``tokenizers`` ``DecodeStream`` vLLM uses, emits a character only once its last byte
arrived.
"""

from __future__ import annotations

import codecs
import sys
from dataclasses import dataclass

from mrl_lightning.thl import token_bytes


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """vLLM 0.32's ``check_stop_strings`` (``vllm/v1/engine/detokenizer.py``), the same rules.

    Args:
        output_text: The completion's text so far, the new characters at its end.
        new_char_count: How many characters at the end are new (0 = nothing to check).
        stop: The stop strings, in the policy's order.
        include_in_output: Keep the stop string in the text (vLLM ``include_stop_str_in_output``).

    Returns:
        None when no stop string ends inside the new text; else ``(stop string, offset)``: the text
        is cut to ``output_text[:offset]``, or not cut when ``offset == -1``.
    """
    if not new_char_count or not stop:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:  # the stop string that completes earliest; ties by list order
            best, best_index, best_end = stop_str, index, end
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index


@dataclass
class Scan:
    """Where one completion ends, by the rules of the module docstring.

    Attributes:
        length: Tokens kept (through the stop token, or the token that completed the stop string).
        stopped: True = finish "stop" (a stop token or a stop string), False = "length".
        stop_reason: vLLM's ``stop_reason``: the stop token's id, the matched stop string, or None.
        text: The cut text when a stop string matched; None otherwise (the caller decodes the kept
            tokens as before).
    """

    length: int
    stopped: bool
    stop_reason: int | str | None
    text: str | None = None


class StopStringScanner:
    """One completion's text, grown token by token, and its stop-string check (:func:`check_stop_strings`).

    Args:
        stop: The stop strings.
        include_in_output: Keep the matched stop string in the text.
    """

    def __init__(self, stop: list[str], include_in_output: bool = False) -> None:
        self.stop, self.include = list(stop), include_in_output
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.matched: str | None = None

    def feed(self, piece: bytes) -> bool:
        """Append one token's bytes; True when a stop string completed (``text`` is then cut)."""
        if self.matched is not None:
            return True
        new = self.decoder.decode(piece)
        self.text += new
        found = check_stop_strings(self.text, len(new), self.stop, self.include)
        if found is None:
            return False
        self.matched, offset = found
        if offset != -1:
            self.text = self.text[:offset]
        return True


def scan_completion(tokenizer, ids: list[int], stop_token_ids, stop: list[str] | None = None,
                    include_stop_str_in_output: bool = False) -> Scan:
    """Where a sampled completion ends: at its first stop token, or at the token whose text completes a stop string.

    Args:
        tokenizer: The policy's fast tokenizer (token bytes).
        ids: ``[L]`` the sampled ids in order (anything after the end, e.g. padding, is ignored).
        stop_token_ids: Ids that end a completion as a token (EOS, end of turn); kept.
        stop: Stop strings; None or empty = none.
        include_stop_str_in_output: Keep the matched stop string in the text.

    Returns:
        :class:`Scan`.
    """
    stops = set(stop_token_ids)
    scanner = StopStringScanner(stop, include_stop_str_in_output) if stop else None
    pieces = token_bytes(tokenizer, ids) if scanner is not None else None
    for k, token in enumerate(ids):
        if token in stops:
            return Scan(k + 1, True, int(token))
        if scanner is not None and scanner.feed(pieces[k]):
            return Scan(k + 1, True, scanner.matched, scanner.text)
    return Scan(len(ids), False, None, None)


def stop_string_criteria(tokenizer, stop: list[str], num_rows: int, include_stop_str_in_output: bool = False):
    """A ``transformers`` stopping criterion that ends each row of a ``generate`` call at its first stop string.

    Each row's new token is fed to its own :class:`StopStringScanner`; a row is done once a stop
    string completed (``generate`` then pads it). :func:`scan_completion` afterwards finds the
    same token, so where generation stopped and where the completion is cut agree.

    Args:
        tokenizer: The policy's fast tokenizer.
        stop: The stop strings (non-empty).
        num_rows: N, rows of the call.
        include_stop_str_in_output: As :class:`StopStringScanner`.

    Returns:
        A ``transformers.StoppingCriteria`` answering ``[N]`` bool (True = done).
    """
    import torch
    from transformers import StoppingCriteria

    class _StopStrings(StoppingCriteria):
        def __init__(self) -> None:
            self.scanners = [StopStringScanner(stop, include_stop_str_in_output) for _ in range(num_rows)]
            self.done = torch.zeros(num_rows, dtype=torch.bool)

        def __call__(self, input_ids, scores, **kwargs):
            pieces = token_bytes(tokenizer, input_ids[:, -1].tolist())
            for row, piece in enumerate(pieces):
                if not self.done[row] and self.scanners[row].feed(piece):
                    self.done[row] = True
            return self.done.to(input_ids.device).clone()

    return _StopStrings()
