"""ReasoningGymAccuracy: strict success vs reasoning-gym's partial credit, on real entries.

reasoning-gym 0.1.25's default ``score_answer`` returns 1.0 for an exact answer and
``len(gold) / len(answer)`` when the gold answer is a substring. A SuccessRecord may
only come from an exactly right answer (docs/grpo.md, "Rewards and success"), so the
strict reward is 1.0 or 0.0; the answer is the first non-empty line, stripped.
"""

from __future__ import annotations

import math

import pytest
import reasoning_gym

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rewards import ReasoningGymAccuracy, extract_answer

ADD_CFG = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"], allow_parentheses=False,
               allow_negation=False)


@pytest.fixture(scope="module")
def add_item():
    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=1, **ADD_CFG)[0]
    assert (entry["question"], entry["answer"]) == ("Calculate 47 + 77.", "124")  # pinned generator
    return PromptItem("add/0", entry["question"], entry["answer"], "add", entry)


@pytest.fixture(scope="module")
def chain_item():
    entry = reasoning_gym.create_dataset("chain_sum", seed=3, size=1)[0]
    assert entry["answer"] == "214"
    return PromptItem("chain/0", entry["question"], entry["answer"], "chain", entry)


# completion -> (strict, partial) by hand for gold "124":
#   exact                           1.0, 1.0
#   "  124  \n because ..."         first line stripped = "124": 1.0, 1.0
#   "\n\n124"                       first non-empty line: 1.0, 1.0
#   "12412"                         substring: strict 0.0, partial 3 / 5 = 0.6
#   "1240"                          substring: strict 0.0, partial 3 / 4 = 0.75
#   "12"                            gold not in it: 0.0, 0.0
#   ""                              0.0, 0.0
CASES = [
    ("124", 1.0, 1.0),
    ("  124  \n because 47 + 77 = 124", 1.0, 1.0),
    ("\n\n124", 1.0, 1.0),
    ("12412", 0.0, 0.6),
    ("1240", 0.0, 0.75),
    ("12", 0.0, 0.0),
    ("", 0.0, 0.0),
]


def test_reasoning_gym_itself_gives_partial_credit_to_substrings(add_item):
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    assert score("12412", add_item.entry) == pytest.approx(0.6)
    assert score(" 124 ", add_item.entry) == pytest.approx(3 / 5)  # whitespace costs credit too


@pytest.mark.parametrize("completion, strict, partial", CASES)
def test_strict_reward_is_one_only_for_the_exact_answer(add_item, completion, strict, partial):
    assert ReasoningGymAccuracy(strict=True)([completion], [add_item]) == [strict]
    assert ReasoningGymAccuracy(strict=False)([completion], [add_item]) == [pytest.approx(partial)]


def test_strict_reward_on_a_second_task(chain_item, add_item):
    # Batch of mixed tasks: each completion is scored by its own item's verifier.
    # chain_sum gold "214": "2140" is a substring hit, 3 / 4 = 0.75 partial, 0 strict.
    completions = ["214", "2140", "124"]
    items = [chain_item, chain_item, add_item]
    assert ReasoningGymAccuracy()(completions, items) == [1.0, 0.0, 1.0]
    assert ReasoningGymAccuracy(strict=False)(completions, items) == [1.0, pytest.approx(0.75), 1.0]


def test_item_without_a_reasoning_gym_source_is_not_scored(add_item):
    foreign = PromptItem("x/0", "q", "124", "x", {"answer": "124", "metadata": {}})
    out = ReasoningGymAccuracy()(["124", "124"], [add_item, foreign])
    assert out[0] == 1.0 and math.isnan(out[1])


def test_names_and_strictness_flags():
    strict, loose = ReasoningGymAccuracy(), ReasoningGymAccuracy(strict=False)
    assert (strict.name, strict.strict) == ("rg_exact", True)
    assert (loose.name, loose.strict) == ("rg_score", False)
    assert strict.version.startswith("reasoning-gym==")


def test_extract_answer_takes_the_first_non_empty_line():
    assert extract_answer("\n  \n 42 \nmore") == "42"
    assert extract_answer("   \n\n") == ""
