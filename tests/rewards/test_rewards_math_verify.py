"""MathVerifyReward on real GSM8K / MATH500 lines: right answers in several surface forms score
1.0, wrong ones 0.0, an unparseable reference NaN; the same from the main thread, a worker
thread and the process pool (signals, hence deadlines, only work on a main thread). Hostile
inputs score NaN within the time bound, and a worker stuck where no signal reaches it is
terminated."""

from __future__ import annotations

import json
import math
import pickle
import signal
import threading
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from math_data import math_data_dir

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards import MathVerifyReward
from mrl_lightning.rewards.math_verify import CheckTimeout, deadline

# (hostile completion, reference): math-verify would run on each for minutes or hours.
HOSTILE = [
    ("\\boxed{9^{9^{9^9}}}", "5"),                                  # a power tower of 9s
    ("\\boxed{10^{10^{4}}}", "10^{10000}"),                          # a 10,000-digit power, two ways
    ("\\boxed{10^{10^{10000}}}", "5"),                               # a power with 10**10000 digits
    ("\\boxed{(10^{8})!}", "5"),
    ("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1"),          # 5,000 nested braces
]


def _row(name: str, index: int) -> dict:
    with open(math_data_dir() / name / "test.jsonl", encoding="utf-8") as f:
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


def test_right_gsm8k_answer_scores_one_in_several_surface_forms(reward, gsm8k_0):
    right = ["... so she makes \\boxed{18} dollars.", "The answer is 18.", "She makes 18.0 dollars",
             "9 * 2 = 18\n#### 18", "<answer>18</answer>", "$\\boxed{\\$18}$"]
    wrong = ["\\boxed{17}", "The answer is 18.5.", "<answer>9</answer> then 18", "I cannot tell."]
    assert reward(right + wrong, [gsm8k_0] * 10) == [1.0] * 6 + [0.0] * 4


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


def test_scores_from_main_thread_and_worker_thread_agree(reward, gsm8k_0, math_2):
    texts, items, expected = _batch(gsm8k_0, math_2)
    assert threading.current_thread() is threading.main_thread()
    assert reward(texts, items) == expected
    results, errors = [], []

    def work():
        try:
            results.append(reward(texts, items))  # no deadline can be set here: the pool scores
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    for _ in range(2):  # the second call reuses the pool
        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=60)
    assert not errors and results == [expected, expected]


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
        MathVerifyReward(executor="thread", max_workers=0, start_method="teleport", answer_timeout_s=-1, timeout_s=0)
    msg = str(info.value)
    for part in ("executor='thread'", "'auto'", "max_workers=0", "start_method='teleport'", "answer_timeout_s=-1",
                 "timeout_s=0"):
        assert part in msg


def test_lengths_must_match(reward):
    with pytest.raises(ValueError):
        reward(["\\boxed{1}"], [])


def _timed(reward, texts, refs):
    items = [PromptItem(f"h/{i}", "q", ref, "h", {}) for i, ref in enumerate(refs)]
    start = time.monotonic()
    out = reward(texts, items)
    return out, time.monotonic() - start


@pytest.mark.parametrize("hostile, reference", HOSTILE,
                         ids=["tower", "10k-digit-power", "huge-power", "factorial", "braces"])
def test_hostile_input_scores_nan_within_five_seconds_on_the_main_thread(reward, hostile, reference):
    assert threading.current_thread() is threading.main_thread()
    out, seconds = _timed(reward, [hostile, "\\boxed{7}"], [reference, "7"])
    assert math.isnan(out[0]) and out[1] == 1.0
    assert seconds < 5.0


def test_hostile_inputs_score_nan_within_five_seconds_from_a_worker_thread(reward):
    results = []

    def work():
        for hostile, reference in HOSTILE[:3]:
            results.append(_timed(reward, [hostile, "\\boxed{7}"], [reference, "7"]))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert len(results) == 3
    for out, seconds in results:
        assert math.isnan(out[0]) and out[1] == 1.0
        assert seconds < 5.0


def test_long_plain_numbers_are_checked_not_dropped(reward):
    big = "1" + "0" * 10_000
    out, seconds = _timed(reward, [f"The answer is {big}.", f"\\boxed{{{big}}}"], ["5", big])
    assert out == [0.0, 1.0] and seconds < 5.0


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask") or not Path("/proc/self/stat").exists(),
                    reason="needs POSIX signal masks and Linux /proc")
def test_worker_stuck_where_no_signal_reaches_is_terminated_and_the_pool_restarts(monkeypatch, tmp_path):
    import os

    import mrl_lightning.rewards.math_verify as module

    original = module.parse_final_answer

    def hang_like_c_code(completion):
        if completion == "hang":
            (tmp_path / "pid").write_text(str(os.getpid()))
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the deadline never fires
            time.sleep(60)
        return original(completion)

    monkeypatch.setattr(module, "parse_final_answer", hang_like_c_code)  # forked workers inherit it
    r = MathVerifyReward(executor="process", max_workers=1, answer_timeout_s=0.5, timeout_s=1.0)
    try:
        with pytest.warns(UserWarning, match="pool failed"):
            out, seconds = _timed(r, ["hang", "\\boxed{7}"], ["1", "7"])
        assert all(math.isnan(x) for x in out) and seconds < 5.0
        pid = int((tmp_path / "pid").read_text())
        for _ in range(50):
            if not _running(pid):
                break
            time.sleep(0.1)
        assert not _running(pid), f"stuck worker {pid} still running"
        assert r._pool is None
        assert _timed(r, ["\\boxed{7}"], ["7"])[0] == [1.0]  # a new pool
    finally:
        r.close()


def test_deadline_raises_in_time_and_restores_the_callers_handler_and_timer():
    def outer(signum, frame):
        raise AssertionError("the outer timer must not fire during this test")

    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        start = time.monotonic()
        with pytest.raises(CheckTimeout):
            with deadline(0.2):
                time.sleep(3)
        assert time.monotonic() - start < 1.0
        with deadline(5.0):
            pass
        assert signal.getsignal(signal.SIGALRM) is outer
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 25.0 < left < 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _SlowFinalizer:
    """Its ``__del__`` outlives the deadline: Python only prints an exception raised there."""

    def __del__(self):
        time.sleep(0.5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_deadline_that_fired_inside_a_finalizer_still_ends_the_block():
    # CI saw this once: the timer fired inside hypothesis's gc callback, the exception was
    # printed and dropped, and the check ran on to 0.0 instead of scoring NaN.
    reached_the_end = []
    with pytest.raises(CheckTimeout):
        with deadline(0.1):
            _SlowFinalizer()  # dropped at once: the deadline fires inside __del__
            reached_the_end.append(True)
    assert reached_the_end == [True]  # the swallowed exception let the block run on


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_deadline_swallowed_once_fires_again_at_once():
    # the check must end near its deadline, not when the interrupted work would have finished
    start = time.monotonic()
    with pytest.raises(CheckTimeout):
        with deadline(0.1):
            _SlowFinalizer()  # the first signal is printed and dropped inside __del__
            time.sleep(5)     # the work that would run on
    assert time.monotonic() - start < 1.0


def test_deadline_refuses_a_thread_other_than_main():
    errors = []

    def work():
        try:
            with deadline(1.0):
                pass
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]
