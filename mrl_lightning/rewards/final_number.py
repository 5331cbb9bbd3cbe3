"""The one number a completion states as its result, or none (docs/answers.md, "Final numbers").

A real model answers in its own words: an instruction model writes "6 * 2 = 12", "The answer is 7." or
"we need to multiply 4 by itself, which is 16. So, 4 * 8 equals " (cut before its result); a base model
continuing a pattern writes " 57" or " 4 + 6 = 10. Question: 2 + 2". A number the text merely mentions
("we need to add 4 and 4", "9 is the smallest even positive integer") is no result, nor is an
unevaluated expression ("The answer is 5 + 5.", ``\\boxed{2^2}``), nor a hedge ("57 or 58"). The reader
finds the text's *statements of a result* and keeps the last one of the most explicit kind:

1. the text is cut where it restarts a new question (``Question:``, ``Q:``, ``Question 2:``, ``Q2:``,
   ``Question 2.``, ``Q.`` after its start);
2. statements, in three ranks (the highest rank present decides; within it the last statement):
   a. the last ``<answer>...</answer>``, else the last ``\\boxed{...}``, else the last GSM8K ``####`` line
      that is one number (``#### 18``; a markdown heading, ``#### 2. Subtract``, is none);
   b. an answer anchor: "the answer (to ...) is X", "answer: X", "X is the (correct) answer",
      "X, which is the answer";
   c. a computed value: ``expr = X`` (the left side, back to the previous ``=`` or the sentence start, holds
      ``a op b``), "equals X" / "is equal to X", "<expr or result noun> is X" (result nouns: sum, product,
      result, total, difference, value, answer), "which is / gives / results in X", "we get X", and a
      completion that starts with a number ending its sentence (" 57", " 10.", "13\\n\\nWhat's next?");
3. a statement's value is X when X is a number (sign, also spaced: ``= - 3``; thousands separators in
   3-digit groups, ``1,000`` or ``1 000``; decimals, a currency sign; a Unicode minus or dash read as ``-``)
   that is *all* of it: not followed by another number (``1 0000``, ``57 58``, ``5:30``), an operator
   (``5 + 5``, ``5 x 5``, ``2^2``, ``2**3``, ``57 ± 1``, ``57 & 58``, "2 times 2"), an alternative ("57 or 58",
   "-2 or 1", "57, 58", "57 (or 58)", "but maybe 58", "57. Or maybe 58.") or, for the leading number, a word (" 10 steps"). A statement whose value is missing
   (cut: "So, 4 * 8 equals "), an expression, a word ("is FizzBuzz") or a hedge gives None: the last
   statement is the completion's result, and an earlier one is not taken instead.

The value is written canonically (``"57"``, ``"-12"``, ``"1234"``, ``"12.5"``). Nothing is evaluated:
an expression is no result, so no sympy or math-verify runs here (no timer, any thread), and a
statement's subject or sentence is looked for within 300 characters, so a long text reads in linear time. None is "no
answer": the reward is 0, never partial. Agreement with hand labels of real completions of both real
models: docs/answers.md, "The labelled set".
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from mrl_lightning.data.sources import last_boxed

RULE_VERSION = "final-number-v5"

_DASHES = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-", "\u2013": "-", "\u2014": "-"})
_WRAPPERS = re.compile(r"\\[()\[\]]|(?<!\\)\$(?!\s*[0-9])|(?<![0-9])\*\*|\*\*(?![0-9])")  # delimiters, bold; 2**3 kept
_RESTART = re.compile(r"(?<=\S)\s*\b(?:(?:Question|Q)(?:\s*[0-9]+)?\s*:|(?:Question|Q)\s*[0-9]+\.(?![0-9])|Q\.(?=\s))")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"^[ \t]*####[ \t]*(.+?)[ \t]*$", re.MULTILINE)
_GROUPS = r"[0-9]{1,3}(?:(?:,[0-9]{3})+|(?:[ \u00a0\u2009\u202f][0-9]{3})+)"  # "1,000", "1 000" (3-digit groups)
_NUM = rf"[-+]?[$\u20ac\u00a3]?(?:{_GROUPS}|[0-9]+)(?:\.[0-9]+)?(?![\w]|\.[0-9])"
_HASH_NUMBER = re.compile(rf"{_NUM}\.?")  # GSM8K's "#### 18": a #### line that is one number, not "#### Step 1"
_SPACED_SIGN = re.compile(r"([-+])[ \t]+(?=[$\u20ac\u00a3]?[0-9])")  # "= - 3"
_NUMBER = re.compile(rf"(?<![\w.]){_NUM}")
_OP = r"(?:\*\*|[-+*/\u00d7\u00f7\u00b1^=<>%&]|\\(?:times|cdot|div)\b|\bx\b|\b(?:times|plus|minus|over|divided|multiplied|" \
      r"more|less|squared|cubed|mod)\b)"
_EXPR = re.compile(rf"[0-9)]\s*{_OP}\s*[(]*\s*[-+]?[0-9]")
_AFTER_BAD = re.compile(rf"[ \t]+[0-9]|:[0-9]|\+/-|\s*(?:{_OP}|[,;/]\s*[-+]?[0-9]|[,;]?\s*\(?\s*or\b|"
                        r"[,;]?\s*and\s+[-+]?[0-9]|[,;]?\s*to\s+[-+]?[0-9]|"
                        r"[,;.!?]?\s*(?:but|or)\s+(?:maybe|perhaps|possibly|also|it\s+(?:could|might|may)))",
                        re.IGNORECASE)  # a hedge also after a sentence end: "57. But maybe 58."
_LEADING = re.compile(rf"\s*({_NUM})")
_LEADING_END = re.compile(r"\s*(?:$|\n|[.!?,;:](?![0-9]))")
_SENTENCE_END = re.compile(r"\n|[.!?](?=\s|$)")
_ANCHOR_ANSWER = re.compile(r"\banswer\b(?:\s+(?:to|for)\b[^.\n=]{0,60}?)?\s*(?:\bis\b|\bwas\b|\bwill\s+be\b|"
                            r"\bwould\s+be\b|=)\s*:?|\banswer\s*:|\banswer\s*$", re.IGNORECASE)  # last: cut before it
_NUMBER_IS_ANSWER = re.compile(rf"(?<![\w.])({_NUM})\s*,?\s*(?:which\s+|that\s+)?(?:is|was)\s+(?:the|my|our)\s+"
                               r"(?:[a-z]+\s+){0,2}answer\b", re.IGNORECASE)
_ADVERB = r"(?:\s+(?:indeed|simply|just|actually|also|exactly))?"
_STRONG = re.compile(rf"=|\bequals\b|\bis{_ADVERB}\s+equal\s+to\b", re.IGNORECASE)
_WEAK = re.compile(rf"\b(?:which\s+(?:is|was|gives(?:\s+us)?|equals|makes|results\s+in)|(?:we|you)\s+get|"
                   rf"gives\s+us|results\s+in){_ADVERB}\b", re.IGNORECASE)
_IS = re.compile(rf"\b(?:is|are|was)(?:\s+(?:calculated|computed)\s+(?:as|to\s+be))?{_ADVERB}\b", re.IGNORECASE)
_RESULT_NOUN = re.compile(r"\b(?:sum|product|result|total|difference|value|answer)\b", re.IGNORECASE)
_CLAUSE_START = re.compile(r".*(?:[.!?;:,\n]|\bwhich\b|\bthat\b|\bso\b)", re.DOTALL | re.IGNORECASE)
_SPACE = re.compile(r"\s*")
_NOT_DIGITS = re.compile(r"[,$\u20ac\u00a3 \u00a0\u2009\u202f]")  # separators and currency signs
_WINDOW = 300  # characters a statement's subject or sentence is looked for in (keeps long texts linear)
_NO_VALUE = object()  # a statement whose value is missing, an expression, a word or a hedge


def _value_at(text: str, pos: int) -> str | object:
    """The number that starts at ``pos`` (after white space) and is the whole value, or :data:`_NO_VALUE`."""
    start = _SPACE.match(text, pos).end()
    sign = _SPACED_SIGN.match(text, start)  # "= - 3": a sign, a space, a number without its own sign
    match = _NUMBER.match(text, sign.end() if sign else start)
    if not match or _AFTER_BAD.match(text, match.end()):
        return _NO_VALUE
    return sign.group(1) + match.group(0) if sign else match.group(0)


def _sentence_value(text: str) -> str | object:
    """The value a short statement states: after its last ``=`` when it has one (``4 * 9 = 36``), else its start."""
    sentence = _SENTENCE_END.split(text.strip(), maxsplit=1)[0]
    last_eq = sentence.rfind("=")
    value = _value_at(sentence, last_eq + 1 if last_eq >= 0 else 0)
    rest = sentence[last_eq + 1:] if last_eq >= 0 else sentence
    if value is not _NO_VALUE and rest.strip().rstrip(".").strip() not in (value, value.lstrip("$\u20ac\u00a3")):
        return _NO_VALUE  # more than the number ("\\sqrt{4}", "57 apples or so"): only a bare number in a box
    return value


def _ranked_statement(text: str) -> tuple[int, str | object] | None:
    """Rank a (a tag, a box, a ``####`` line) with its value, or None when there is none."""
    tags = _ANSWER_TAG.findall(text)
    found = tags[-1] if tags else last_boxed(text)
    if found is None:
        hashes = [h for h in _HASHES.findall(text) if _HASH_NUMBER.fullmatch(h)]
        found = hashes[-1] if hashes else None
    return None if found is None else (0, _sentence_value(found))


def _answer_statements(text: str) -> list[tuple[int, str | object]]:
    """Rank b: (position, value) of each answer anchor."""
    out = []
    for m in _ANCHOR_ANSWER.finditer(text):
        start = _SPACE.match(text, m.end()).end()
        sentence = _SENTENCE_END.split(text[start:start + _WINDOW], maxsplit=1)[0]
        if "=" in sentence:  # "The answer is: 4 * 9 = 36."
            out.append((m.start(), _value_at(sentence, sentence.rfind("=") + 1)))
        else:
            out.append((m.start(), _value_at(text, m.end())))
    for m in _NUMBER_IS_ANSWER.finditer(text):
        before = text[max(0, m.start() - _WINDOW):m.start()].rstrip()
        expression = before != "" and before[-1] in "+-*/^\u00d7\u00f7"  # "5 + 5 is the answer"
        out.append((m.start(), _NO_VALUE if expression else m.group(1)))
    return out


def _computed_statements(text: str) -> list[tuple[int, str | object]]:
    """Rank c: (position, value) of each computed value and of a leading number."""
    out = []
    for m in _STRONG.finditer(text):
        if m.group(0) == "=":
            start = max(text.rfind("=", max(0, m.start() - _WINDOW), m.start()) + 1, _sentence_start(text, m.start()))
            if not _EXPR.search(text[start:m.start()]):
                continue  # "0 = 1", "10:09 = 9": no computation on the left
        out.append((m.start(), _value_at(text, m.end())))
    for m in _WEAK.finditer(text):
        if _number_or_cut(text, m.end()):  # "which is the associative property" states nothing
            out.append((m.start(), _value_at(text, m.end())))
    for m in _IS.finditer(text):
        clause = text[max(0, m.start() - _WINDOW):m.start()]
        head = _CLAUSE_START.match(clause)
        subject = clause[head.end():] if head else clause
        if (_EXPR.search(subject) or _RESULT_NOUN.search(subject)) and _number_or_cut(text, m.end()):
            out.append((m.start(), _value_at(text, m.end())))  # not "9 is the smallest ...", "... is undefined"
    lead = _LEADING.match(text)
    if lead:
        fine = _LEADING_END.match(text, lead.end()) and not _AFTER_BAD.match(text, lead.end())
        out.append((lead.start(1), lead.group(1) if fine else _NO_VALUE))
    return out


def _number_or_cut(text: str, pos: int) -> bool:
    """Whether a number (maybe an expression's first) follows ``pos``, or the text ends there (cut)."""
    start = _SPACE.match(text, pos).end()
    sign = _SPACED_SIGN.match(text, start)
    return start == len(text) or bool(_NUMBER.match(text, sign.end() if sign else start))


def _sentence_start(text: str, pos: int) -> int:
    """Where the sentence holding ``pos`` starts."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text, max(0, pos - _WINDOW), pos)]
    return ends[-1] if ends else max(0, pos - _WINDOW)


def stated_result(completion: str) -> str | None:
    """The number ``completion`` states as its result, as written (sign and separators kept), or None.

    Args:
        completion: Completion text (already cut at its stop string, if any).

    Returns:
        The raw number of the deciding statement (module docstring), e.g. ``"1,234"``; None when there is
        no statement of a result or the deciding one states no single number.
    """
    text = _WRAPPERS.sub("", completion.translate(_DASHES))
    restart = _RESTART.search(text)
    text = text[:restart.start()] if restart else text
    ranked = _ranked_statement(text)
    if ranked is not None:
        value = ranked[1]
    else:
        statements = _answer_statements(text) or _computed_statements(text)
        value = max(statements, key=lambda s: s[0])[1] if statements else _NO_VALUE
    return None if value is _NO_VALUE else value


def final_number(completion: str) -> str | None:
    """The number the completion states as its result, written canonically; else None (module docstring).

    Args:
        completion: Completion text (already cut at its stop string, if any).

    Returns:
        E.g. ``"57"`` for "53 + 4 = 57. The answer is 57.", ``"-12"`` for " -12", ``"1234"`` for
        "The total is 1,234 apples."; None for "57 or 58", "we need to add 53 and", "The answer is 5 + 5."
        or "".
    """
    raw = stated_result(completion)
    if raw is None:
        return None
    try:
        value = Decimal(_NOT_DIGITS.sub("", raw))
    except InvalidOperation:  # the pattern admits only numbers; kept as a guard
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
