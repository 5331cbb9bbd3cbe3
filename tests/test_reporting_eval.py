"""Evaluation scalars: mean@k and the unbiased pass@k (Chen et al. 2021), merged over ranks; the console line.

The system is a stand-in whose sampled successes per prompt are fixed by the test, so
every expected number is counted by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.data.items import PromptItem
from mrl_lightning.loop.reporting import (
    eval_counts,
    eval_metrics_from_counts,
    eval_summary,
    merge_eval_counts,
    pass_at_k,
)


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 1, 0.4),                 # k = 1: c / n
    (5, 2, 2, 1 - 3 / 10),          # 1 - C(3, 2) / C(5, 2)
    (10, 3, 5, 1 - 21 / 252),       # 1 - C(7, 5) / C(10, 5)
    (4, 0, 4, 0.0),
    (4, 1, 4, 1.0),                 # k = n: any success
    (4, 4, 2, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 5), (4, 5, 2), (0, 0, 1), (4, 1, 0)])
def test_pass_at_k_out_of_range_is_refused(n, c, k):
    with pytest.raises(ValueError, match=f"pass_at_k\\(n={n}, c={c}, k={k}\\)"):
        pass_at_k(n, c, k)


K = 4
# Sampled successes of each held-out prompt (of K): part "gsm8k" is the policy's strong part.
HITS = {"gsm8k": {"g0": 2, "g1": 0, "g2": 1, "g3": 4}, "math500": {"m0": 0, "m1": 1, "m2": 0, "m3": 0}}


class FakeSystem:
    """Greedy solves every other prompt; sampling gives ``HITS[prompt]`` successes of K."""

    def __init__(self):
        self.policies = {"p": SimpleNamespace(strong_parts=["gsm8k"], render_prompt=lambda item: item.question)}

    def greedy_success(self, policy, items):
        ok = [int(x.prompt_id[1:]) % 2 == 0 for x in items]
        return sum(ok) / len(ok), [x.question for x in items]

    def rollout_n(self, policy, items, k, prompt_seeds=None):
        hits = [HITS[x.part][x.prompt_id] for x in items]
        return torch.tensor([[j < h for j in range(k)] for h in hits])

    def score(self, texts, items):
        return None, None, torch.zeros(len(texts), dtype=torch.bool)


def _items():
    return {part: [PromptItem(pid, f"q {pid}", "1", part, {}) for pid in hits] for part, hits in HITS.items()}


def _counts(shard_indices):
    counts, _ = eval_counts(FakeSystem(), _items(), ["p"], 1, K, lambda name, part, *i: 0, shard_indices=shard_indices)
    return counts


def test_mean_and_pass_at_k_by_hand_and_existing_tags_kept():
    metrics = eval_metrics_from_counts(FakeSystem(), merge_eval_counts([_counts(lambda n, size: list(range(size)))]))
    # gsm8k: mean of 2/4, 0/4, 1/4, 4/4 = 0.4375; pass@4 = prompts with a success: 3 of 4.
    assert metrics["eval/p/mean_at_k_gsm8k"] == pytest.approx(0.4375)
    assert metrics["eval/p/pass_at_k_gsm8k"] == pytest.approx(0.75)
    # math500: 1/4 of one prompt -> 0.0625; pass@4 = 1 of 4.
    assert metrics["eval/p/mean_at_k_math500"] == pytest.approx(0.0625)
    assert metrics["eval/p/pass_at_k_math500"] == pytest.approx(0.25)
    assert metrics["eval/p/pass_at_k_strong"] == pytest.approx(0.75)
    assert metrics["eval/p/pass_at_k_weak"] == pytest.approx(0.25)
    # the tags that were there before: sampled success 7/16 and 1/16, greedy 2/4 each
    assert metrics["eval/p/success_gsm8k"] == pytest.approx(7 / 16)
    assert metrics["eval/p/success_math500"] == pytest.approx(1 / 16)
    assert metrics["eval/p/greedy_success_gsm8k"] == pytest.approx(0.5)
    assert metrics["eval/p/success_strong"] == pytest.approx(7 / 16)


def test_two_ranks_merged_give_the_one_rank_numbers():
    one = eval_metrics_from_counts(FakeSystem(), merge_eval_counts([_counts(lambda n, size: list(range(size)))]))
    ranks = [_counts(lambda n, size: [0, 1]), _counts(lambda n, size: [2, 3])]
    merged = merge_eval_counts(ranks)
    assert merged["p"]["per_prompt"]["gsm8k"] == ([2, 0, 1, 4], K)
    assert eval_metrics_from_counts(FakeSystem(), merged) == pytest.approx(one)


def test_greedy_only_evaluation_has_no_pass_at_k():
    counts, _ = eval_counts(FakeSystem(), _items(), ["p"], 1, 0, lambda name, part, *i: 0)
    metrics = eval_metrics_from_counts(FakeSystem(), merge_eval_counts([counts]))
    assert "eval/p/success_gsm8k" in metrics and not any("_at_k_" in key for key in metrics)


def test_ranks_with_different_k_are_refused():
    a = {"p": {"per_prompt": {"gsm8k": ([1], 4)}}}
    b = {"p": {"per_prompt": {"gsm8k": ([1], 8)}}}
    with pytest.raises(ValueError, match="ranks sampled k=4 and k=8"):
        merge_eval_counts([a, b])


def _policy_metrics(name, strong, weak, greedy_weak):
    return {f"eval/{name}/success_add": strong, f"eval/{name}/greedy_success_add": 0.99,
            f"eval/{name}/success_strong": strong, f"eval/{name}/success_weak": weak,
            f"eval/{name}/greedy_success_strong": 0.99, f"eval/{name}/greedy_success_weak": greedy_weak,
            f"eval/{name}/pass_at_k_weak": 0.5}


def test_eval_line_shows_every_policy_in_words_when_there_are_few():
    metrics = {**_policy_metrics("gpt2", 0.87, 0.031, 0.029), **_policy_metrics("llama", 0.6, 0.05, 0.0)}
    assert eval_summary(metrics) == ("gpt2 strong 0.87 weak 0.03 (greedy 0.03) | "
                                     "llama strong 0.60 weak 0.05 (greedy 0.00)")


def test_eval_line_is_compact_with_one_legend_when_there_are_many():
    metrics = {}
    for i, name in enumerate(["gpt2", "llama", "qwen2", "phi3"]):
        metrics.update(_policy_metrics(name, 0.9 - i / 10, i / 100, i / 50))
    line = eval_summary(metrics)
    assert line == ("strong/weak (greedy weak): gpt2 0.90/0.00 (0.00) | llama 0.80/0.01 (0.02) | "
                    "qwen2 0.70/0.02 (0.04) | phi3 0.60/0.03 (0.06)")
    assert "\n" not in line


def test_eval_line_shows_a_policy_without_strong_parts_by_part():
    metrics = {**_policy_metrics("gpt2", 0.87, 0.03, 0.02),
               "eval/fresh/success_add": 0.5, "eval/fresh/greedy_success_add": 0.4, "eval/fresh/success_sub": 0.1,
               "eval/fresh/mean_at_k_sub": 0.1}
    assert eval_summary(metrics) == "gpt2 strong 0.87 weak 0.03 (greedy 0.02) | fresh add 0.50 sub 0.10"


def test_eval_line_leaves_out_a_weak_value_when_every_part_is_strong():
    metrics = {"eval/p/success_add": 0.7, "eval/p/success_strong": 0.7, "eval/p/greedy_success_strong": 0.6}
    assert eval_summary(metrics) == "p strong 0.70"
