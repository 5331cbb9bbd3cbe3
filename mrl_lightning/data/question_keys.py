"""question_key: when two prompts ask the same question, for held-out evaluation (docs/default.md).

Evaluation is held out by question, not by row: a part's evaluation rows are distinct by
this key, and every training row whose key is an evaluation key is dropped. Exact text is
not enough for arithmetic: "Calculate 4 * 9." evaluated while "Calculate 9 * 4." is trained
measures recall of a trained fact. The key reads reasoning-gym's ``metadata['expression']``
for the datasets whose expression is the whole question (``EXPRESSION_DATASETS``: basic_arithmetic,
chain_sum, products, decimal_chain_sum; the entry's ``metadata['source_dataset']`` names it):

- a pure product (``a * b * ...``): the multiset of its factors;
- a pure chain of ``+`` and ``-`` (``a + b - c``): the multiset of its signed terms
  (``a``, ``b``, ``-c``), so commuted addends share a key ("3 + 4", "4 + 3"), and so do
  reordered subtrahends ("4 - 1 - 7", "4 - 7 - 1"), while "5 - 3" and "3 - 5" do not;
- any other expression (division, mixed ``+`` and ``*``, parentheses): the expression
  itself, whitespace normalized;
- any other reasoning-gym dataset: the question text as it is. Elsewhere ``expression`` is not
  the question (circuit_logic's leaves out the input values that decide the answer, countdown's
  is one solution among several), and whitespace can be part of it (circuit_logic draws its
  circuit in spaces);
- no metadata naming a dataset (GSM8K / MATH rows): the question text, whitespace normalized.

Two questions with one key have the same value (a multiset of factors or of signed terms
fixes the product or the sum), so a key never merges questions with different answers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

_OPERATORS = {"+", "-", "*"}
EXPRESSION_DATASETS = frozenset({"basic_arithmetic", "chain_sum", "products", "decimal_chain_sum"})
_TOKEN = re.compile(r"\d+(?:\.\d+)?|\S")


def _number(token: str) -> Fraction | None:
    """The value of one numeric token ("7", "-3", "2.5"), or None when it is not a plain number."""
    if not token.lstrip("+-").replace(".", "", 1).isdigit():
        return None
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def _tokens(expression: str) -> list[str]:
    """``expression``'s numbers and operators, whatever its spacing ("3+5", "3 +5" and "3 + 5" alike); a sign
    where a number is expected (at the start, after an operator or "(") is folded into that number."""
    out: list[str] = []
    for token in _TOKEN.findall(expression):
        if out and out[-1] in ("-", "+") and _number(token) is not None and (
                len(out) == 1 or out[-2] in _OPERATORS | {"/", "("}):
            out.append(("-" if out.pop() == "-" else "") + token)
        else:
            out.append(token)
    return out


def _multiset(values: list[Fraction]) -> str:
    return ",".join(str(v) for v in sorted(values))


def question_key(question: str, metadata: Mapping[str, Any] | None = None) -> str:
    """The canonical key of one question: equal for commuted ``+`` / ``*`` operands (module docstring).

    Args:
        question: The prompt's question text.
        metadata: The reasoning-gym entry's ``metadata`` (its ``expression`` is read when its
            ``source_dataset`` is in ``EXPRESSION_DATASETS``), or None.

    Returns:
        ``"product:<sorted factors>"``, ``"sum:<sorted signed terms>"``, ``"expression:<expr>"``
        or ``"text:<question>"``.
    """
    dataset = metadata.get("source_dataset") if isinstance(metadata, Mapping) else None
    expression = metadata.get("expression") if dataset in EXPRESSION_DATASETS else None
    if not isinstance(expression, str) or not expression.strip():
        return "text:" + (question if dataset else " ".join(question.split()))
    tokens = _tokens(expression)
    numbers = [_number(t) for t in tokens[0::2]]
    operators = tokens[1::2]
    pure = (len(tokens) % 2 == 1 and all(n is not None for n in numbers) and set(operators) <= _OPERATORS)
    if pure and operators and set(operators) == {"*"}:
        return "product:" + _multiset(numbers)
    if pure and "*" not in operators:
        signed = [numbers[0]] + [n if op == "+" else -n for op, n in zip(operators, numbers[1:])]
        return "sum:" + _multiset(signed)
    return "expression:" + " ".join(tokens)
