"""The one number a completion gives as its final answer, or none (docs/answers.md, "Final numbers").

A real model answers in its own words: an instruction model writes "53 + 4 = 57. The answer is
57.", a base model continuing a few-shot pattern writes " 57". A verifier that wants the bare
value needs the number read out of such text, and a success that SGT shares must stay strict on
the value: "57 or 58" states two answers and is not a success even though one of them is right.
math-verify (``rewards/answers.py``) takes the *last* number of a hedge ("58 or 57" reads 57, "The
answer is 57 or 58." reads 57), so this module reads the final answer the way math-verify looks
for it and then asks that it be one value:

1. the answer statement, the first rule that finds one:
   a. the content of the last ``<answer>...</answer>``;
   b. the content of the last ``\\boxed{...}`` (braces matched);
   c. GSM8K's last ``#### ...`` line;
   d. what follows the last "answer is" / "answer:" (any case), to the end of its sentence;
   e. the last sentence of the text that holds a number (sentences end at a newline, or at ``.``,
      ``!`` or ``?`` followed by white space or the end; a decimal point is not an end), so that a
      completion cut by the length limit after its answer ("..., which is 165. This is the") is
      read at its answer;
2. the statement's result: what follows its last ``=``, "equals", "is", "are", "gives" or "makes",
   when a number follows it ("The sum of 53 and 4 is 57." -> "57."); else the whole statement
   ("57 is the answer.");
3. its numbers (an optional sign, a Unicode minus ``\u2212`` read as ``-``, digits with optional
   thousands separators ``1,234`` and decimals ``12.5``; a currency sign or a unit set apart by a
   space is ignored, a unit glued to the number, ``5kg``, makes it no number): the answer when they all have one
   value (``57`` and ``57.0`` agree), written canonically (``"57"``, ``"-12"``, ``"1234"``, ``"12.5"``);
   None when there is none or more than one value (a hedge, or a statement that is not an answer:
   "we need to add 53 and 4").

None is "no answer": the reward is 0, never partial.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from mrl_lightning.data.sources import last_boxed

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"^[ \t]*####[ \t]*(.+?)[ \t]*$", re.MULTILINE)
_ANCHOR = re.compile(r"\banswer\b\s*(?:is\b|:)\s*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\n|(?<=[.!?])(?=\s|$)")
_RESULT = re.compile(r"=|\bequals?\b|\bis\b|\bare\b|\bgives\b|\bmakes\b", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})  # a Unicode minus is a minus
RULE_VERSION = "final-number-v2"


def answer_statement(completion: str) -> str:
    """The part of ``completion`` that states its final answer (rule 1 of the module docstring)."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1]
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(completion)
    if hashes:
        return hashes[-1]
    anchors = list(_ANCHOR.finditer(completion))
    if anchors:
        rest = completion[anchors[-1].end():]
        return _SENTENCE_END.split(rest, maxsplit=1)[0]
    sentences = [s for s in _SENTENCE_END.split(completion) if _NUMBER.search(s)]
    return sentences[-1] if sentences else ""


def statement_result(statement: str) -> str:
    """What follows the statement's last ``=`` / "equals" / "is" / ... when a number follows it (rule 2)."""
    marks = list(_RESULT.finditer(statement))
    if marks and _NUMBER.search(statement, marks[-1].end()):
        return statement[marks[-1].end():]
    return statement


def final_number(completion: str) -> str | None:
    """The completion's final answer when it is one number, written canonically; else None (module docstring).

    Args:
        completion: Completion text (already cut at its stop string, if any).

    Returns:
        E.g. ``"57"`` for "53 + 4 = 57. The answer is 57.", ``"-12"`` for " -12", ``"1234"`` for
        "The total is 1,234 apples."; None for "57 or 58", "we need to add 53 and" or "".
    """
    values = set()
    completion = completion.translate(_MINUS_SIGNS)
    for text in _NUMBER.findall(statement_result(answer_statement(completion))):
        try:
            values.add(Decimal(text.replace(",", "")))
        except InvalidOperation:  # the pattern admits only numbers; kept as a guard
            return None
    if len(values) != 1:
        return None
    value = values.pop()
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
