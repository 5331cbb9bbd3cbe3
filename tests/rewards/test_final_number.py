"""Final numbers (docs/answers.md, "Final numbers"): a real model's answer read from its words, strict on the value.

The texts are what SmolLM2-135M-Instruct (its chat template, greedy, 32 new tokens) and Gemma 3
270M base (a few-shot template cut at its newline stop) wrote on reasoning-gym prompts here
(benchmarks/real_task_choice.py), plus hedges. Where one number is stated, the value agrees with
math-verify's reading of the same text; where two are, math-verify takes the last and this rule
takes none, so "57 or 58" is never a success.
"""

from __future__ import annotations

import pytest
import reasoning_gym

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards import ReasoningGymAccuracy, final_number
from mrl_lightning.rewards.answers import answers_match, parse_final_answer, parse_reference

# text -> the number it states as its final answer (worked out by reading it), or None
STATED = [
    ("To calculate 4 + 6, we simply add them together. 4 + 6 equals 10.", "10"),             # SmolLM2
    ("To calculate 95 + 70, we need to add 95 and 70, which is 165. This is the", "165"),      # SmolLM2, cut at 32
    ("To calculate 5 + 10, we need to add 5 and 10, which is 15. This is a classic example of", "15"),
    ("The answer is 2.", "2"),                                                                  # SmolLM2, chain_sum
    ("53 + 4 = 57. The answer is 57.", "57"),
    ("To calculate 53 + 4, we need to add 53 and 4.\n\n53 + 4 = 57", "57"),
    ("The sum of 53 and 4 is 57.", "57"),
    ("10 + 3 = 4\n\nThis is a classic example of a mathematical operation that can be performed by", "4"),
    (" 57", "57"),                                                                               # Gemma, cut at "\n"
    (" -14", "-14"),
    (" 1,234", "1234"),
    ("The answer is $\\boxed{57}$.", "57"),
    ("57.0", "57"),
    (" 12.5", "12.5"),
    ("#### 18", "18"),
    ("<answer>18</answer> (I checked: 9 + 9 = 18)", "18"),
    ("57 is the answer.", "57"),
    ("The answer is \u22122.", "-2"),                                                          # a Unicode minus sign
]
HEDGES = [
    "57 or 58",
    "58 or 57",
    "The answer is 57 or 58.",
    "I think it's 57, but maybe 58.",
    "Answer: 57 (or 58)",
    "57, 58",
]
NO_ANSWER = ["To calculate 53 + 4, we need to add 53 and", "", "I cannot answer that."]


@pytest.mark.parametrize("text, number", STATED)
def test_the_stated_number_is_read(text, number):
    assert final_number(text) == number


@pytest.mark.parametrize("text, number", [(t, n) for t, n in STATED if n != "4"])
def test_the_value_agrees_with_math_verify_where_one_number_is_stated(text, number):
    assert answers_match(parse_reference(number), parse_final_answer(text))


@pytest.mark.parametrize("text", HEDGES)
def test_a_hedge_states_no_answer(text):
    assert final_number(text) is None


def test_math_verify_alone_would_accept_a_hedge_that_ends_with_the_gold():
    """Why the rule exists: math-verify reads the last number of "58 or 57" (and the anchored first one of
    "The answer is 57 or 58."), which is the gold 57."""
    gold = parse_reference("57")
    assert answers_match(gold, parse_final_answer("58 or 57"))
    assert answers_match(gold, parse_final_answer("The answer is 57 or 58."))


# reproduced faults of final-number-v2 (each read wrong there): text -> what it states
FAULTS = [
    ("To calculate 4 + 4, we need to add 4 and 4.", None),                      # v2: 4, a mention
    ("The answer is 5 + 5.", None),                                             # v2: 5, an expression
    ("So the area is 5 x 5.", None),                                            # v2: 5
    ("The answer is $\\boxed{2^2}$.", None),                                  # v2: 2
    ("The answer is $\\boxed{\\sqrt{4}}$.", None),                          # v2: 4
    (" 4 + 6 = 10. Question: 2 + 2", "10"),                                     # v2: 2, Gemma restarts a question
    ("The result of 0 * 3 is undefined. This is because 0 is not defined as a number.", None),  # v2: 0, a success
    ("To calculate 9 * 1, we need to find the smallest even positive integer. Since 9 is the smallest even "
     "positive integer", None),                                                 # v2: 9, a success for 9 * 1
    ("10 * 3 = 30\n\nThis is an expression of multiplication with 3 and 10", "30"),  # v2: 10
    ("4 * 9 = 36, which is the correct answer.", "36"),                         # v2: none
    ("The answer is 36, which is the product of 4 and 9.", "36"),               # v2: none
    ("So, 4 * 4 = ", None),                                                     # v2: 4, cut before its result
    ("To calculate 4 * 4, we need to multiply 4 by itself, which is 16. So, 4 * 4 = ", None),  # v2: 4
]


@pytest.mark.parametrize("text, number", FAULTS)
def test_a_fault_of_the_old_reader_is_read_as_stated(text, number):
    """An operand, an expression, a mention or a restarted question is no result; an equation states its value."""
    assert final_number(text) == number


# reproduced faults of final-number-v3 (each read wrong there): text -> what it states
FAULTS_V3 = [
    # F1: a markdown heading "#### ..." is no GSM8K answer line (only "#### <number>" is)
    ("#### 1. Compute 3 * 4\n3 * 4 = 12\n#### 2. Subtract\n12 - 15 = -3\nThe answer is -3.", "-3"),  # v3: 2
    ("#### 2. Multiply the numbers\n3 * 4 = 12", "12"),                                 # v3: 2
    ("#### Step 1: Multiply\n3 * 4 = 12\n#### Step 2: Subtract\n12 - 15 = -3\nThe answer is -3.", "-3"),  # v3: none
    ("#### 5 + 5\n3 * 4 = 12.\n#### 13.", "13"),                                       # v3: 13 (still: a number line)
    # F2: space thousands separators, as "1,000" reads 1000
    ("The answer is 1 000.", "1000"),                                                 # v3: 1
    ("3 * 4 = 12. So the total is 12 345 apples.", "12345"),                          # v3: 12
    ("The answer is 1\u00a0000\u00a0000.", "1000000"),                                # v3: 1, a no-break space
    ("The answer is 1 0000.", None),                                                  # v3: 1, two numbers
    ("The answer is 57 58.", None),                                                   # v3: 57
    # F3: a numbered restart of a new question
    (" 4 + 6 = 10. Question 2: 5 * 5 = 25", "10"),                                     # v3: 25
    (" 4 + 6 = 10. Q2: 5 * 5 = 25", "10"),                                             # v3: 25
    (" 4 + 6 = 10. Question 2. 5 * 5 = 25", "10"),                                     # v3: 25
    ("The answer is 7.\nQ. What is 2+2? A: 4", "7"),                                   # v3: 7 too (a guard)
    # a space after the sign
    ("2 - 5 = - 3", "-3"),                                                            # v3: none
    ("2 - 5 = \u2212 3.", "-3"),                                                       # v3: none
    ("The answer is - 3.", "-3"),                                                     # v3: none
    ("5 - 3 is the answer.", None),                                                   # v3: none too: an expression
]


@pytest.mark.parametrize("text, number", FAULTS_V3)
def test_a_fault_of_the_v3_reader_is_read_as_stated(text, number):
    """Only "#### <number>" is a GSM8K answer line; "1 000" is one number; "Question 2:" restarts; "- 3" is -3."""
    assert final_number(text) == number


FAULTS_V4 = [
    # a Python-style power is an expression, not bold markdown around digits
    ("The answer is 2**3.", None),                                                    # v4: 23
    (" 2**3", None),                                                                  # v4: 23
    ("2**3 = 8", "8"),                                                                # v4: none
    ("The answer is **57**.", "57"),                                                  # v4: 57 too (a guard)
    ("**The answer is 57**", "57"),                                                   # v4: 57 too (a guard)
    # a hedge or a second value after a sentence end, a plus-minus, an ampersand, a clock time
    ("The answer is 57. But maybe 58.", None),                                        # v4: 57
    ("The answer is 57. Or maybe 58.", None),                                         # v4: 57
    ("The answer is 57 \u00b1 1.", None),                                             # v4: 57
    ("The answer is 57 +/- 1.", None),                                                # v4: 57
    ("The answer is 57 & 58.", None),                                                 # v4: 57
    ("The answer is 5:30.", None),                                                    # v4: 5
    ("The answer is 57. But 4 + 4 = 8 is easy.", "57"),                               # a guard: the anchor outranks
]


@pytest.mark.parametrize("text, number", FAULTS_V4)
def test_a_fault_of_the_v4_reader_is_read_as_stated(text, number):
    """``**`` between digits is a power, not bold; a hedge after a sentence end, ``\u00b1``, ``&`` and ``5:30`` state none."""
    assert final_number(text) == number


@pytest.mark.parametrize("text", NO_ANSWER)
def test_a_text_without_an_answer_states_none(text):
    assert final_number(text) is None


@pytest.fixture(scope="module")
def add_item():
    cfg = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"], allow_parentheses=False,
               allow_negation=False)
    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=1, **cfg)[0]
    assert (entry["question"], entry["answer"]) == ("Calculate 47 + 77.", "124")  # pinned generator
    return PromptItem("add/0", entry["question"], entry["answer"], "add", entry)


def test_final_number_mode_rewards_the_value_in_words_and_never_a_hedge(add_item):
    reward = ReasoningGymAccuracy(answer="final_number")
    texts = ["47 + 77 = 124. The answer is 124.", "The sum of 47 and 77 is 124.", " 124", "124 or 125",
             "125 or 124", "The answer is 124 or 125.", "47 + 77 = 123", "We need to add 47 and"]
    assert reward(texts, [add_item] * len(texts)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert reward.strict and reward.name == "rg_exact_final_number" and reward.version.endswith("final-number-v5")


def test_the_default_first_line_mode_is_unchanged(add_item):
    """The tiny default's reward: first line, strict, same name and version as before the option existed."""
    reward = ReasoningGymAccuracy()
    texts = [" 124\nQuestion: 3 + 4", "47 + 77 = 124. The answer is 124.", "124 or 125", "1240"]
    assert reward(texts, [add_item] * len(texts)) == [1.0, 0.0, 0.0, 0.0]
    assert reward.name == "rg_exact" and reward.version == f"reasoning-gym=={reasoning_gym.__version__}"


def test_an_unknown_answer_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"ReasoningGymAccuracy.answer='last'; valid: \['first_line', 'final_number'\]"):
        ReasoningGymAccuracy(answer="last")


def test_long_texts_are_read_in_linear_time_off_the_main_thread():
    """No timer and no quadratic scan: a 30,000-character text of statements reads in well under a second, in a thread."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    texts = ["the sum is " * 3000, "= " * 15000, "4 * 9 = 36. " * 2500, "answer is " * 3000]
    start = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        read = list(pool.map(final_number, texts))
    assert read == [None, None, "36", None] and time.perf_counter() - start < 5.0
