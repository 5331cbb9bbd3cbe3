"""Answers in the shapes GSM8K and MATH500 completions take, checked end to end.

Each row is (completion, reference, verdict), the verdict worked out by hand. Rows marked
``# rule N`` need the hand-written rule N of ``mrl_lightning.rewards.answers``; the
``test_library_alone_misses_*`` tests show math-verify without that rule getting them wrong,
which is the reason each rule exists.
"""

from __future__ import annotations

import pytest

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rewards import MathVerifyReward, answers_match, parse_final_answer, parse_reference
from mrl_lightning.rewards.answers import final_answer_source

LONG_GAP = "That misses the condition on the remainder, so I redo the count from the start and get"

GSM8K_ROWS = [
    ("Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18", "18", 1),
    ("#### 18\nThen 19 more cookies were baked.", "18", 1),                       # rule 2
    ("#### Step 1\nShe sells 9 eggs at $2 each, so the answer is 18.", "18", 1),  # a heading is no answer
    ("#### 2. Multiply\nShe sells 9 eggs at $2 each: 9 * 2 = 18.", "2", 0),  # a numbered heading is no answer
    ("#### 1) Sell\nShe sells 9 eggs at $2 each.\n#### 18", "18", 1),
    ("The answer is 18.", "18", 1),
    ("The answer is 18.5.", "18", 0),
    ("She makes \\boxed{18} dollars.", "18", 1),
    ("$\\boxed{\\$18}$", "18", 1),
    ("She makes \\$18 every day.", "18", 1),                                        # rule 3
    ("The final answer is **18**.", "18", 1),                                       # markdown bold
    ("**Answer:** 17", "18", 0),
    ("The house is worth 70,000 dollars.", "70000", 1),                             # thousands separator
    ("\\boxed{70,000}", "70000", 1),
    ("So the total is 2125.", "2,125", 1),
    ("The total is 2,125 dollars.", "2,125", 1),
    ("\\boxed{1,450,000}", "1,450,000", 1),
    ("The total is 2,124.", "2,125", 0),
    ("<answer>18</answer>", "18", 1),                                               # rule 1
    ("<answer>9</answer> and later 18", "18", 0),                                   # rule 1: the tag wins
    ("The temperature falls to -5 degrees.", "-5", 1),                              # negative number
    ("The answer is **-5**.", "-5", 1),
    ("\\boxed{5}", "-5", 0),
    ("The discount is 25%.", "25", 1),                                              # percentage
    ("\\boxed{25\\%}", "25\\%", 1),
    ("\\boxed{0.25}", "25\\%", 1),
    ("The rope is 42 meters long.", "42", 1),                                       # units
    ("\\boxed{18 \\text{ dollars}}", "18", 1),
    ("\\boxed{5.4}", "5.4 \\text{ cents}", 1),
    ("I cannot tell.", "18", 0),
]

MATH500_ROWS = [
    ("The pair is (0,1).", "(0,1)", 1),                                             # rule 4
    ("The answer is $\\frac{3}{4}$.", "0.75", 1),                                   # fraction vs decimal
    ("\\boxed{0.75}", "\\frac{3}{4}", 1),
    ("\\boxed{\\frac{14}{3}}", "\\frac{14}{3}", 1),
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", 1),                                # \dfrac
    ("\\boxed{4.67}", "\\frac{14}{3}", 0),
    ("\\boxed{\\frac{3}{14}}", "\\frac{14}{3}", 0),
    ("\\boxed{0.34}", "\\dfrac{17}{50}", 1),
    ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1),  # tuple
    ("\\boxed{(\\frac{\\pi}{2}, 3)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0),
    ("\\boxed{(1,0)}", "(0,1)", 0),
    ("The interval is [-2, 7).", "[-2,7)", 1),                                      # rule 4, interval
    ("\\boxed{(-2, 7)}", "[-2,7)", 0),
    ("\\boxed{(2,12) \\cup (12,102)}", "(2,12) \\cup (12,102)", 1),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1),                                     # \text{}
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1),
    ("\\boxed{\\text{Bob}}", "\\text{Evelyn}", 0),
    ("\\boxed{\\sqrt{52}}", "2\\sqrt{13}", 1),
    ("The answer is 3\\sqrt{13}.", "3\\sqrt{13}", 1),                               # rule 5
    ("p - q", "p - q", 1),                                                          # rule 5
    ("\\boxed{90}", "90^\\circ", 1),
    ("\\boxed{-\\frac{1}{2}}", "-\\frac{1}{2}", 1),
    ("\\boxed{\\frac{1}{2}}", "-\\frac{1}{2}", 0),
    ("\\boxed{10080}", "10,\\!080", 1),
    (f"First guess: \\boxed{{3}}. {LONG_GAP} \\boxed{{5}}.", "5", 1),               # several boxed: the last
    (f"First guess: \\boxed{{3}}. {LONG_GAP} \\boxed{{5}}.", "3", 0),
    ("x = \\boxed{1} or x = \\boxed{3}", "1, 3", 1),                                # several boxed: one answer
    ("\\boxed{3, 1}", "1, 3", 1),
    ("\\boxed{x = 5}", "x=5", 1),
    ("\\boxed{6 - 5i}", "6 - 5i", 1),
    ("\\boxed{3}. Check: 3 + 4 = 7.", "3", 1),
    ("\\boxed{\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}}",
     "\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}", 1),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1),
]

ROWS = GSM8K_ROWS + MATH500_ROWS


def test_table_is_large_and_has_both_verdicts():
    assert len(ROWS) >= 40
    assert {v for _, _, v in GSM8K_ROWS} == {0, 1} and {v for _, _, v in MATH500_ROWS} == {0, 1}


@pytest.mark.parametrize("completion, reference, verdict", ROWS)
def test_answer_table(completion, reference, verdict):
    assert answers_match(parse_reference(reference), parse_final_answer(completion)) == bool(verdict)


def test_reward_gives_the_table_verdicts_in_one_call():
    reward = MathVerifyReward()
    try:
        items = [PromptItem(f"t/{i}", "q", ref, "t", {}) for i, (_, ref, _) in enumerate(ROWS)]
        assert reward([c for c, _, _ in ROWS], items) == [float(v) for _, _, v in ROWS]
    finally:
        reward.close()


def _library_alone(completion: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(completion, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()])


@pytest.mark.parametrize("completion, reference", [
    ("<answer>18</answer>", "18"),                               # rule 1: nothing found inside tags
    ("#### 18\nThen 19 more cookies were baked.", "18"),          # rule 2: a later number wins
    ("She makes \\$18 every day.", "18"),                         # rule 3: nothing after "\$"
    ("The pair is (0,1).", "(0,1)"),                              # rule 4: no tuple in plain text
    ("The interval is [-2, 7).", "[-2,7)"),                       # rule 4: only its last number
    ("The answer is 3\\sqrt{13}.", "3\\sqrt{13}"),                # rule 5: LaTeX needs delimiters
    ("p - q", "p - q"),                                           # rule 5
])
def test_library_alone_misses_what_the_rules_catch(completion, reference):
    from math_verify import verify

    assert not verify(parse_reference(reference), _library_alone(completion))
    assert answers_match(parse_reference(reference), parse_final_answer(completion))


@pytest.mark.parametrize("completion, rule, text", [
    ("\\boxed{1} <answer>2</answer>", "answer_tag", "2"),
    ("<answer>1</answer> <ANSWER> 2 </ANSWER>", "answer_tag", " 2 "),
    ("#### 18\nnot 19", "hashes", "18"),
    ("#### $1,234\n", "hashes", "$1,234"),
    ("#### Step 1\nThe answer is 3.", "library", "#### Step 1\nThe answer is 3."),
    ("\\boxed{5}\n#### 4", "library", "\\boxed{5}\n#### 4"),   # a boxed answer beats a hashes line
])
def test_final_answer_source_follows_the_documented_order(completion, rule, text):
    assert final_answer_source(completion) == (rule, text)


@pytest.mark.parametrize("completion", ["(1,000) apples", "$f(0,1) = 3$", "P(0,1) is on the line"])
def test_tuples_inside_math_or_calls_or_thousands_are_not_rewritten(completion):
    from mrl_lightning.rewards.answers import _wrap_plain_tuples

    assert _wrap_plain_tuples(completion) == completion


def test_empty_or_blank_references_parse_to_nothing():
    assert parse_reference("") == [] and parse_reference("  $ $ ") == []
