"""Metric kinds combine over ranks as their producers declare (mrl_lightning/metrics.py); values by hand."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from mrl_lightning.metrics import ESS, Global, Max, Mean, Min, Moments, Ratio, Sum, combine_metrics, window_reduce


def test_each_kind_combines_over_two_ranks_as_one_rank_on_the_whole_batch():
    # rank 0 saw rewards [1, 0, 0] (3 completions), rank 1 saw [1] (1 completion)
    rank0 = {"sum": Sum(2.0), "mean": Mean(1 / 3, 3), "max": Max(1.1), "min": Min(0.9), "std": Moments.of([1, 0, 0]),
             "share": Ratio(1, 4), "global": Global(10.0), "plain": 0.2, "only_here": 7.0}
    rank1 = {"sum": Sum(3.0), "mean": Mean(1.0, 1), "max": Max(1.3), "min": Min(0.95), "std": Moments.of([1]),
             "share": Ratio(3, 4), "global": Global(10.0), "plain": 0.4}
    got = combine_metrics([rank0, rank1])
    assert got["sum"] == 5.0
    assert got["mean"] == pytest.approx(0.5)  # (1/3 * 3 + 1 * 1) / 4, not the mean of means 2/3
    assert got["max"] == 1.3 and got["min"] == 0.9
    assert got["std"] == pytest.approx(math.sqrt((2 - 2 * 2 / 4) / 3))  # std of [1, 0, 0, 1], Bessel: 0.577
    assert got["share"] == pytest.approx(0.5)  # (1 + 3) / (4 + 4)
    assert got["global"] == 10.0 and got["plain"] == pytest.approx(0.3) and got["only_here"] == 7.0


def test_effective_sample_share_pools_exactly_from_shifted_sums():
    log_w = torch.tensor([0.0, math.log(2.0), math.log(4.0), -30.0], dtype=torch.float64)
    whole = ESS.of(log_w)
    w = log_w.exp()
    assert whole == pytest.approx(float(w.sum() ** 2 / (w.pow(2).sum() * 4)))
    parts = combine_metrics([{"e": ESS.of(log_w[:1])}, {"e": ESS.of(log_w[1:])}])["e"]
    assert parts == pytest.approx(whole, rel=1e-12)


def test_a_window_is_the_mean_of_its_steps_and_a_global_counter_its_last_value():
    steps = [{"r": Mean(0.2, 8), "n": Global(5.0)}, {"r": Mean(0.4, 2), "n": Global(7.0), "late": Sum(1.0)}]
    assert window_reduce(steps) == pytest.approx({"r": 0.3, "n": 7.0, "late": 1.0})
    assert all(type(v) is float for v in window_reduce(steps).values())


@pytest.mark.parametrize("value", [Sum(2.0), Mean(0.5, 3), Max(1.0), Min(0.0), Moments.of([1, 2]), Ratio(1, 3),
                                   ESS.of(torch.tensor([0.0, 1.0])), Global(4.0)])
def test_kinds_survive_pickling_with_their_fields(value):
    """They travel between ranks through torch.distributed's object collectives."""
    back = pickle.loads(pickle.dumps(value))
    assert type(back) is type(value) and back == value and vars(back) == vars(value)


def test_a_zero_weight_rank_does_not_count_and_an_empty_ratio_takes_its_empty_value():
    assert combine_metrics([{"m": Mean(0.0, 0)}, {"m": Mean(0.8, 5)}])["m"] == pytest.approx(0.8)
    assert combine_metrics([{"r": Ratio(0, 0, empty=1.0)}, {"r": Ratio(0, 0, empty=1.0)}])["r"] == 1.0


@pytest.mark.parametrize("kind", [Max, Min])
def test_a_nan_extreme_is_nan_wherever_it_sits(kind):
    """A non-finite step logs NaN (grpo_grad_norm, ratios): the window's Max / Min must show it, in any order."""
    import math

    for order in ([kind(math.nan), kind(0.5), kind(0.2)], [kind(0.5), kind(math.nan), kind(0.2)]):
        assert math.isnan(window_reduce([{"x": v} for v in order])["x"])
        assert math.isnan(combine_metrics([{"x": v} for v in order])["x"])
    assert window_reduce([{"x": kind(0.5)}, {"x": kind(0.2)}])["x"] == (0.5 if kind is Max else 0.2)


def test_inner_iterations_fold_by_kind():
    """num_iterations > 1: a Max keeps the largest iteration, a Min the smallest, the rest the last one."""
    from mrl_lightning.update.policy_update import _fold

    metrics: dict = {}
    _fold(metrics, {"share_max": Max(0.46), "grpo_min": Min(0.92), "share": 0.46})
    _fold(metrics, {"share_max": Max(0.30), "grpo_min": Min(1.82), "share": 0.30})
    assert metrics == {"share_max": 0.46, "grpo_min": 0.92, "share": 0.30}
    assert isinstance(metrics["share_max"], Max) and isinstance(metrics["grpo_min"], Min)
