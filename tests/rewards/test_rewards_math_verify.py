"""MathVerifyReward on real GSM8K / MATH500 lines: right answers in several surface forms score
1.0, wrong ones 0.0, an unparseable reference NaN; the same from the main thread, a worker
thread and the process pool (math-verify's signal.alarm only works on a main thread)."""

from __future__ import annotations

import json
import math
import pickle
import threading
from importlib.metadata import version
from pathlib import Path

import pytest

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards import MathVerifyReward, extract_final_answer

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").is_file()
                                 or not (DATA / "math500" / "test.jsonl").is_file(),
                                 reason=f"real GSM8K / MATH500 lines not found under {DATA}")


def _row(name: str, index: int) -> dict:
    with open(DATA / name / "test.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == index:
                return json.loads(line)
    raise IndexError(index)


@pytest.fixture(scope="module")
def reward():
    r = MathVerifyReward(max_workers=2)
    yield r
    r.close()


@pytest.fixture(scope="module")
def gsm8k_0() -> PromptItem:
    """GSM8K test row 0 (Janet's ducks): the solution ends in '#### 18' (hand-checked)."""
    row = _row("gsm8k", 0)
    assert row["answer"].endswith("#### 18")
    return PromptItem("gsm8k/0", row["question"], "18", "gsm8k", {})


@pytest.fixture(scope="module")
def math_2() -> PromptItem:
    """MATH500 row 2: f(-2) + f(-1) + f(0) = 2 + 5/3 + 1 = 14/3."""
    row = _row("math500", 2)
    assert row["answer"] == "\\frac{14}{3}"
    return PromptItem("math500/2", row["problem"], row["answer"], "math500", {})


@pytest.fixture(scope="module")
def math_0() -> PromptItem:
    """MATH500 row 0: (0, 3) in polar coordinates is (3, pi/2)."""
    row = _row("math500", 0)
    assert row["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    return PromptItem("math500/0", row["problem"], row["answer"], "math500", {})


@pytest.mark.parametrize("text, expected", [
    ("So \\boxed{18}. Later 19 apples.", "18"),                 # 1. boxed beats a later number
    ("\\boxed{\\frac{1}{2}} <answer>3</answer>", "\\frac{1}{2}"),  # 1. boxed beats the answer tag
    ("\\boxed{a{b}c} end", "a{b}c"),                             # braces balanced
    ("<answer>18</answer> or 19", "18"),                         # 2. tag beats a later number
    ("<ANSWER> 5 </ANSWER>", "5"),
    ("16 - 3 - 4 = 9\n#### 18\nnot 19", "18"),                  # 3. GSM8K style
    ("The answer is 72.", "72"),                                 # 4. last number, no final period
    ("It costs $1,234.50 in total", "1,234.50"),
    ("x = 3/4.", "3/4"),
    ("no digits here", None),
    ("\\boxed{}", None),
])
def test_final_answer_is_extracted_in_the_documented_order(text, expected):
    assert extract_final_answer(text) == expected


@needs_data
def test_right_gsm8k_answer_scores_one_in_several_surface_forms(reward, gsm8k_0):
    right = ["... so she makes \\boxed{18} dollars.", "The answer is 18.", "She makes 18.0 dollars",
             "9 * 2 = 18\n#### 18", "<answer>18</answer>", "$\\boxed{\\$18}$"]
    wrong = ["\\boxed{17}", "The answer is 18.5.", "<answer>9</answer> then 18", "I cannot tell."]
    assert reward(right + wrong, [gsm8k_0] * 10) == [1.0] * 6 + [0.0] * 4


@needs_data
def test_latex_fractions_and_tuples_of_math500_are_verified(reward, math_2, math_0):
    texts = ["\\boxed{\\frac{14}{3}}", "\\boxed{\\dfrac{14}{3}}", "<answer>14/3</answer>",
             "\\boxed{4\\frac{2}{3}}", "\\boxed{\\frac{3}{14}}", "\\boxed{4.67}",
             "\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "\\boxed{(3, \\pi/2)}", "\\boxed{(\\frac{\\pi}{2}, 3)}"]
    items = [math_2] * 6 + [math_0] * 3
    assert reward(texts, items) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_unparseable_reference_gives_nan_and_others_still_score(reward):
    empty = PromptItem("x/0", "q", "", "x", {})
    dollars = PromptItem("x/1", "q", "$$", "x", {})
    seven = PromptItem("x/2", "q", "7", "x", {})
    out = reward(["\\boxed{1}", "\\boxed{1}", "\\boxed{7}"], [empty, dollars, seven])
    assert math.isnan(out[0]) and math.isnan(out[1]) and out[2] == 1.0


def _batch(gsm8k_0, math_2):
    texts = ["\\boxed{18}", "The answer is 17.", "\\boxed{\\frac{14}{3}}", "\\boxed{5}"] * 4
    return texts, [gsm8k_0, gsm8k_0, math_2, math_2] * 4, [1.0, 0.0, 1.0, 0.0] * 4


@needs_data
def test_scores_from_main_thread_and_worker_thread_agree(reward, gsm8k_0, math_2):
    texts, items, expected = _batch(gsm8k_0, math_2)
    assert threading.current_thread() is threading.main_thread()
    assert reward(texts, items) == expected
    results, errors = [], []

    def work():
        try:
            results.append(reward(texts, items))  # signal.alarm would raise here in-process
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    for _ in range(2):  # the second call reuses the pool
        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=60)
    assert not errors and results == [expected, expected]


@needs_data
def test_process_executor_is_used_from_the_main_thread_too(gsm8k_0, math_2):
    texts, items, expected = _batch(gsm8k_0, math_2)
    r = MathVerifyReward(executor="process", max_workers=3)
    try:
        assert r(texts, items) == expected
        assert r._pool is not None
        assert r([], []) == []
    finally:
        r.close()
    assert r._pool is None


def test_reward_is_strict_and_versioned_and_pickles_without_its_pool(reward):
    assert reward.strict and reward.name == "math_verify"
    assert f"math-verify=={version('math-verify')}" in reward.version
    copy = pickle.loads(pickle.dumps(reward))
    assert copy._pool is None and copy.version == reward.version


def test_bad_options_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        MathVerifyReward(executor="thread", max_workers=0, start_method="teleport", timeout_s=0)
    msg = str(info.value)
    for part in ("executor='thread'", "'auto'", "max_workers=0", "start_method='teleport'", "timeout_s=0"):
        assert part in msg


def test_lengths_must_match(reward):
    with pytest.raises(ValueError):
        reward(["\\boxed{1}"], [])
