"""Final answers of completions and references, found by math-verify's own extractors.

math-verify's ``parse`` already knows how people write answers: the last ``\\boxed{...}``
(its ``LatexExtractionConfig`` with ``boxed_match_priority=0`` puts boxed answers first),
then "final answer is ..." and "answer: ..." anchors, then LaTeX environments and plain
numbers or expressions (``ExprExtractionConfig``), with thousands separators, percentages,
currency signs, units and ``\\text{}`` handled by its normalizer. This module calls it with
those two extractors and adds a hand-written rule only where a test
(``tests/rewards/test_answers_table.py``) shows the library missing a case:

1. ``<answer>...</answer>``: the library does not look inside tags, so the last tag's
   content is parsed on its own (and wins over everything else in the text).
2. GSM8K's ``#### 18``: without a ``\\boxed`` in the text, the last ``####`` line whose
   content starts like a number (digit, sign, ``$``, ``.``, ``(``) is the answer; the
   library alone would take any later number ("#### 18" then "19 cookies" gives 19).
   Markdown headings such as ``#### Step 1`` start with a letter and are not answers, nor
   numbered ones (``#### 2. Multiply the numbers``: a number, ``.``, ``)`` or ``:``, then a word).
3. Escaped dollar signs (``\\$18``): removed first; the library misses a number that
   follows a backslash-dollar in plain text.
4. Plain-text tuples and intervals (``(0,1)``, ``[-2, 7)``) outside math delimiters are
   wrapped in ``$...$`` so that the library's LaTeX extractor sees them; alone it reads
   no tuple in plain text and would take their last number. A group that reads as one
   number with thousands separators (``(1,000)``) is left alone.
5. In a text with no math delimiters (``$``, ``\\(``, ``\\[``, ``\\boxed``), a last line that
   looks like math (no word of two or more letters once LaTeX commands and ``\\text{}``
   are removed), after an optional "answer is" / "answer:", is wrapped in ``$...$``: the
   library reads LaTeX only inside delimiters, so ``The answer is 3\\sqrt{13}.`` gave 3
   and a bare ``p - q`` nothing.

Rules 3, 5 and 4 rewrite the text, in that order, before the library reads it; the
library's own priorities then choose among everything it finds. A fragment taken by
rules 1-2 is parsed as text first, then, when that finds nothing, as ``\\boxed{fragment}``
(so a bare ``\\frac{\\pi}{2}`` parses). References are parsed as
``\\boxed{reference}``: written that way, all 500 MATH500 and 1,319 GSM8K reference answers
parse and verify against themselves (``tests/rewards/test_reference_answers.py``).

Time: none of these functions bounds its own run time (math-verify's own timeouts are
turned off here because they use ``signal.alarm``, which would cancel the caller's
timer); :class:`~mrl_lightning.rewards.math_verify.MathVerifyReward` bounds each check.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"^[ \t]*####[ \t]*([-+$.(\d\\][^\n]*?)[ \t]*$", re.MULTILINE)
_NUMBERED_HEADING = re.compile(r"\d+[.):][ \t]+[A-Za-z]")  # "#### 2. Multiply", "#### 1) Add": a step, not an answer
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_ESCAPED_DOLLAR = re.compile(r"\\\$")
_NUM = r"-?\d+(?:\.\d+)?"
_PLAIN_TUPLE = re.compile(rf"(?<![\w\\$^_}}(\[])[(\[]\s*{_NUM}(?:\s*,\s*{_NUM})+\s*[)\]](?![\w^_])")
_THOUSANDS = re.compile(r"[(\[][1-9]\d{0,2}(?:,\d{3})+[)\]]")
_MATH_OPEN_CLOSE = re.compile(r"(?<!\\)\$|\\\(|\\\)|\\\[|\\\]")
_DELIMITERS = re.compile(r"\$|\\\(|\\\[|\\(?:boxed|fbox)\b")
_LAST_LINE = re.compile(r"\s*(?:.*?\b(?i:answer)\b(?:\s+is)?\s*:?\s*)?(?:\*\*)?(?P<math>.*?)(?:\*\*)?\s*\.?\s*")
_TEXT_ARG = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


class _NoTimeoutWarning(logging.Filter):
    """Drops math-verify's one-time "Timeout is disabled" warning: the caller bounds time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _library():
    """``(parse, verify, extraction targets)`` of math-verify, imported once (it imports sympy)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutWarning())
    targets = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return parse, verify, targets


def _in_math(text: str, pos: int) -> bool:
    """True when ``pos`` lies inside ``$...$``, ``$$...$$``, ``\\(...\\)`` or ``\\[...\\]``."""
    dollars, bracket = 0, False
    for match in _MATH_OPEN_CLOSE.finditer(text, 0, pos):
        token = match.group()
        if token == "$":
            dollars += 1
        else:
            bracket = token in ("\\(", "\\[")
    return dollars % 2 == 1 or bracket


def _wrap_plain_tuples(text: str) -> str:
    """Rule 4: ``(0,1)`` in plain text becomes ``$(0,1)$``; tuples inside math stay as they are."""
    out, last = [], 0
    for match in _PLAIN_TUPLE.finditer(text):
        if _THOUSANDS.fullmatch(match.group()) or _in_math(text, match.start()):
            continue
        out.append(text[last:match.start()] + "$" + match.group() + "$")
        last = match.end()
    return "".join(out) + text[last:]


def _looks_like_math(text: str) -> bool:
    """No word of two or more letters once LaTeX commands, ``\\text{...}`` and environment names are removed."""
    return bool(text.strip()) and not _WORD.search(_COMMAND.sub(" ", _TEXT_ARG.sub(" ", text)))


def _wrap_bare_last_line(text: str) -> str:
    """Rule 5: in a text with no math delimiters, a math-looking last line goes inside ``$...$``."""
    if _DELIMITERS.search(text):
        return text
    lines = text.rstrip().rsplit("\n", 1)
    match = _LAST_LINE.fullmatch(lines[-1])
    if match is None or not _looks_like_math(match.group("math")):
        return text
    lines[-1] = lines[-1][:match.start("math")] + "$" + match.group("math") + "$" + lines[-1][match.end("math"):]
    return "\n".join(lines)


def _prepare(text: str) -> str:
    """Rules 3, 5 and 4 applied, in that order, to a text before math-verify sees it."""
    return _wrap_plain_tuples(_wrap_bare_last_line(_ESCAPED_DOLLAR.sub("", text)))


def _parse_text(text: str) -> list:
    parse, _, targets = _library()
    return parse(_prepare(text), targets, parsing_timeout=None)


def _parse_fragment(fragment: str) -> list:
    """A bare answer: as text first, else as ``\\boxed{fragment}``."""
    fragment = fragment.strip()
    if not fragment:
        return []
    return _parse_text(fragment) or _parse_text("\\boxed{" + fragment.strip("$").strip() + "}")


def final_answer_source(completion: str) -> tuple[str, str]:
    """Which rule gives the completion's final answer, and the text it is parsed from.

    Args:
        completion: Completion text.

    Returns:
        ``(rule, text)``: rule is "answer_tag", "hashes" (both: the fragment) or "library"
        (the whole completion).
    """
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return "answer_tag", tags[-1]
    if not _BOXED.search(completion):
        hashes = [h for h in _HASHES.findall(completion) if not _NUMBERED_HEADING.match(h)]
        if hashes:
            return "hashes", hashes[-1]
    return "library", completion


def parse_final_answer(completion: str) -> list:
    """The completion's final answer as math-verify parses it (module docstring, rules 1-5).

    Not bounded in time; call it under a deadline (``MathVerifyReward`` does).

    Args:
        completion: Completion text.

    Returns:
        math-verify's ``parse`` output: ``[sympy object, its source string]`` (or only the
        string when sympy could not read it); ``[]`` when no answer is found.
    """
    rule, text = final_answer_source(completion)
    return _parse_text(text) if rule == "library" else _parse_fragment(text)


def parse_reference(reference: str) -> list:
    """A reference answer parsed as ``\\boxed{reference}`` (surrounding ``$`` stripped).

    Not bounded in time; call it under a deadline.

    Args:
        reference: The prompt's reference answer (``PromptItem.answer``), e.g. ``"2,125"``
            or ``"\\left( 3, \\frac{\\pi}{2} \\right)"``.

    Returns:
        math-verify's ``parse`` output; ``[]`` when the reference is empty or unreadable.
    """
    reference = reference.strip().strip("$").strip() if reference else ""
    if not reference:
        return []
    parse, _, targets = _library()
    return parse("\\boxed{" + reference + "}", targets, parsing_timeout=None)


def answers_match(reference: list, answer: list) -> bool:
    """math-verify's ``verify(gold, target)`` with its own timeouts off (the caller bounds time).

    Args:
        reference: ``parse_reference`` output (gold; ``verify`` is not symmetric).
        answer: ``parse_final_answer`` output.

    Returns:
        True when both are non-empty and math-verify finds them equal.
    """
    if not reference or not answer:
        return False
    _, verify, _ = _library()
    return bool(verify(reference, answer, timeout_seconds=None))
