"""MWRA by cost (docs/mwra.md, "Placement by cost"): the arithmetic of a prediction, the candidates, the choice, a
calibration of a real architecture's one layer (runs of two workers: tests/e2e/test_mwra_fit.py)."""

from __future__ import annotations

import types

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import build_placement, resolve_devices
from mrl_lightning.mwra.cost import (ALLREDUCE_BYTES_PER_S, PolicyCost, calibrate, candidates, choose,
                                     one_layer_config, predict)

POLICY = types.SimpleNamespace(num_generations=4, max_prompt_length=16, max_completion_length=8, num_iterations=1,
                               beta=0.0, use_peft=False, share_prompt_forward=False)


def unit_cost(name: str, per_row: float, trained: int = 0, fixed: float = 0.0) -> PolicyCost:
    """A policy whose every unit costs ``fixed`` + ``per_row`` seconds a row, one layer."""
    pair = (fixed + 4 * per_row, fixed + 16 * per_row)
    return PolicyCost(policy=name, rows=(4, 16), prefill=pair, decode=pair, generate=pair, fwd_bwd=pair, fwd=pair,
                      head_step=pair, head_fwd_bwd=pair, head_fwd=pair, adamw_per_param=0.0, layers=1, prompt=16,
                      completion=2, trained=trained)


def test_a_phase_is_the_formula_of_its_units_at_the_rows_of_a_rank():
    cost = unit_cost("a", 0.01)
    cost.layers, cost.forwards, cost.iterations = 3, 1, 2
    sampling, update = cost.phases(8)
    r = 0.08  # every unit at 8 rows
    assert sampling == pytest.approx(r + 2 * (r + 2 * r) + 2 * r)  # generate + (L-1)(prefill + C decode) + C head
    assert update == pytest.approx(2 * (3 * r + r) + 1 * (3 * r + r))


def test_disjoint_waits_for_the_slowest_and_colocated_adds_every_policy():
    costs, policies = {"a": unit_cost("a", 0.01), "b": unit_cost("b", 0.03)}, {"a": POLICY, "b": POLICY}
    alone = {n: sum(costs[n].phases(16)) for n in costs}  # 4 prompts x 4 completions on one rank
    disjoint = predict(costs, policies, 4, {"a": 1, "b": 1}, "disjoint")
    assert disjoint.step_s == pytest.approx(alone["b"])
    assert disjoint.idle["a"] == pytest.approx(1 - alone["a"] / alone["b"]) and disjoint.idle["b"] == 0
    colocated = predict(costs, policies, 4, {"a": 2, "b": 2}, "colocated")
    halves = sum(sum(costs[n].phases(8)) for n in costs)  # each rank: 2 prompts of each policy
    assert colocated.step_s == pytest.approx(halves) and not colocated.idle
    assert "idle 67%" in disjoint.line() and "colocated (a: 2, b: 2)" in colocated.line()


def test_a_group_of_several_ranks_pays_a_ring_all_reduce_of_its_gradients():
    costs = {"a": unit_cost("a", 0.0, trained=10**9), "b": unit_cost("b", 0.0)}
    got = predict(costs, {"a": POLICY, "b": POLICY}, 4, {"a": 4, "b": 1}, "disjoint", "cpu")
    assert got.phases["a"][2] == pytest.approx(2 * 3 / 4 * 4e9 / ALLREDUCE_BYTES_PER_S["cpu"])
    assert got.phases["b"][2] == 0.0


def test_candidates_are_colocated_and_every_split_of_the_ranks():
    found = candidates(["a", "b", "c"], 5)
    assert found[0] == ("colocated", {"a": 5, "b": 5, "c": 5})
    splits = [ranks for mode, ranks in found if mode == "disjoint"]
    assert len(splits) == 6 and all(sum(r.values()) == 5 and min(r.values()) >= 1 for r in splits)  # C(4, 2)
    assert candidates(["a", "b"], 1) == [("colocated", {"a": 1, "b": 1})]


def test_the_choice_follows_the_costs_fixed_parts_favour_disjoint_row_parts_favour_colocated():
    policies = {"a": POLICY, "b": POLICY}
    rows_only = choose({"a": unit_cost("a", 0.01), "b": unit_cost("b", 0.03)}, policies, 4, 4, "cpu")
    assert [p.step_s for p in rows_only] == sorted(p.step_s for p in rows_only)
    assert rows_only[0].mode == "colocated"  # every rank splits every policy's rows: nothing idles
    fixed = choose({"a": unit_cost("a", 0.001, fixed=0.1), "b": unit_cost("b", 0.003, fixed=0.1)}, policies, 4, 4,
                   "cpu")
    assert fixed[0].mode == "disjoint" and fixed[0].ranks["b"] >= fixed[0].ranks["a"]  # the slower one gets more
    two_prompts = choose({"a": unit_cost("a", 0.01), "b": unit_cost("b", 0.03)}, policies, 2, 4, "cpu")
    assert two_prompts and all(max(p.ranks.values()) <= 2 for p in two_prompts)  # no rank without a prompt


def test_calibrating_one_layer_of_a_real_architecture_times_every_unit():
    from transformers import LlamaConfig

    from mrl_lightning.mwra.memory import model_shape

    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=999)
    small = one_layer_config(config)
    assert (small.num_hidden_layers, small.vocab_size, small.pad_token_id) == (1, 256, 0)
    assert config.num_hidden_layers == 3  # a copy
    cost = calibrate("tiny", POLICY, model_shape(config), 4, "cpu", "32-true", threads=1)
    assert cost.rows == (4, 16) and cost.layers == 3 and cost.trained == model_shape(config).params
    for unit in ("prefill", "decode", "generate", "fwd_bwd", "fwd", "head_step", "head_fwd_bwd", "head_fwd"):
        assert all(t > 0 for t in getattr(cost, unit)), unit
    sampling, update = cost.phases(16)
    assert sampling > 0 and update > 0


def test_placement_cost_resolves_as_auto_until_the_cost_model_runs_and_refuses_policy_ranks():
    assert build_placement("cost", None, ["a", "b"], 2).mode == "disjoint"
    assert build_placement("cost", None, ["a", "b"], 1).mode == "colocated"
    with pytest.raises(ConfigError, match="trainer.policy_ranks=.*placement: cost, which chooses the ranks"):
        build_placement("cost", {"a": 1, "b": 1}, ["a", "b"], 2)
    got = resolve_devices("cuda", 2, "cost", "auto", {"cuda": 1})
    assert (got.devices, got.placement) == (1, "colocated")


def test_num_iterations_repeat_the_optimizer_step_and_the_all_reduce():
    once, twice = unit_cost("a", 0.0, trained=10**6), unit_cost("a", 0.0, trained=10**6)
    once.adamw_per_param = twice.adamw_per_param = 1e-6
    twice.iterations = 2
    assert twice.phases(8)[1] == pytest.approx(2 * once.phases(8)[1]) and once.phases(8)[1] == pytest.approx(1.0)
    policies = {"a": POLICY, "b": POLICY}
    one = predict({"a": once, "b": unit_cost("b", 0.0)}, policies, 4, {"a": 2, "b": 2}, "colocated")
    two = predict({"a": twice, "b": unit_cost("b", 0.0)}, policies, 4, {"a": 2, "b": 2}, "colocated")
    assert one.phases["a"][2] > 0 and two.phases["a"][2] == pytest.approx(2 * one.phases["a"][2])


def test_the_choice_keeps_only_placements_the_checks_allow_and_may_be_empty():
    costs, policies = {"a": unit_cost("a", 0.01), "b": unit_cost("b", 0.03)}, {"a": POLICY, "b": POLICY}
    kept = choose(costs, policies, 4, 2, "cpu", allowed=lambda mode, ranks: mode == "disjoint")
    assert [p.mode for p in kept] == ["disjoint"]
    assert choose(costs, policies, 1, 4, "cpu") == []  # one prompt a step: no placement of 4 ranks gives each one


def _trainer(world: int):
    fabric = types.SimpleNamespace(strategy=types.SimpleNamespace(cluster_environment=None),
                                   device=types.SimpleNamespace(type="cpu"))
    return types.SimpleNamespace(placement_mode="cost", fabric=fabric, num_threads=1, devices_per_node=world,
                                 num_nodes=1, precision="32-true")


def test_rank_0_hands_its_placement_on_even_when_it_falls_back_and_a_worker_refuses_another(monkeypatch):
    import mrl_lightning.lifeline as lifeline
    from mrl_lightning.mwra import cost as cost_module
    from mrl_lightning.mwra.cost import CHOICE_ENV, place_by_cost

    names, placement = {"a": POLICY, "b": POLICY}, build_placement("cost", None, ["a", "b"], 2)
    monkeypatch.setenv(CHOICE_ENV, '{"world": 2, "mode": "colocated", "groups": {"a": [0, 1], "b": [0, 1]}}')  # stale
    monkeypatch.setattr(lifeline, "is_launched_worker", lambda: False)
    monkeypatch.setattr(cost_module, "calibrate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no layer")))
    chosen, text = place_by_cost(_trainer(2), placement, names, {"a": None, "b": None}, 4, None)
    assert chosen.mode == "disjoint" and "the calibration failed: RuntimeError: no layer" in text
    monkeypatch.setattr(lifeline, "is_launched_worker", lambda: True)  # the worker it starts runs the same
    assert place_by_cost(_trainer(2), placement, names, {}, 4, None)[0] == chosen
    monkeypatch.setenv(CHOICE_ENV, '{"world": 2, "mode": "colocated", "groups": {"x": [0, 1], "y": [0, 1]}}')
    with pytest.raises(ConfigError, match="found no placement from rank 0 for 2 ranks and policies"):
        place_by_cost(_trainer(2), placement, names, {}, 4, None)
