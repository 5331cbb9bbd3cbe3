"""The bandit itself: initial policies, sampling, THL residual, settings and measurement (docs/bandit.md)."""

from __future__ import annotations

import numpy as np
import pytest

from mrl_lightning.analysis.bandit import (
    corrupt,
    expected_reward,
    half_means,
    make_problem,
    sample_actions,
    softmax,
)
from mrl_lightning.analysis.config import BanditConfig, ProbeSpec
from mrl_lightning.analysis.simulate import (
    draw_samples,
    measure_update,
    stochastic_update,
)


def PROBE(name: str) -> ProbeSpec:
    return {p.name: p for p in BanditConfig().probe_specs}[name]


def test_families_start_good_where_the_other_is_weak():
    prob = make_problem(8, 5, seed=0, strong_prob=0.9, weak_prob=1e-3)
    weak, strong = half_means(expected_reward(prob.init_logits, prob.reward), prob.weak)
    np.testing.assert_allclose(weak, [1e-3, 1e-3], rtol=1e-9)
    np.testing.assert_allclose(strong, [0.9, 0.9], rtol=1e-9)
    assert (prob.weak[0] == ~prob.weak[1]).all()
    assert prob.weak[0, 4:].all() and not prob.weak[0, :4].any()
    assert (prob.reward.sum(-1) == 1).all()


def test_make_problem_names_every_bad_argument():
    with pytest.raises(ValueError) as err:
        make_problem(3, 1, seed=0, strong_prob=1.5, weak_prob=0.0)
    msg = str(err.value)
    for name in ("num_contexts=3", "num_actions=1", "strong_prob=1.5", "weak_prob=0.0"):
        assert name in msg


def test_sampled_frequencies_match_policy():
    probs = np.array([[0.1, 0.2, 0.7]])
    actions = sample_actions(probs, 50_000, np.random.default_rng(0))
    freq = np.bincount(actions.ravel(), minlength=3) / actions.size
    np.testing.assert_allclose(freq, probs[0], atol=0.01)


def test_sampling_with_batch_draws_independent_copies():
    probs = softmax(np.zeros((2, 3, 4)))
    actions = sample_actions(probs, 5, np.random.default_rng(0), batch=(7,))
    assert actions.shape == (7, 2, 3, 5)
    assert actions.min() >= 0 and actions.max() <= 3


def test_thl_residual_zero_keeps_and_one_replaces_uniformly():
    rng = np.random.default_rng(1)
    actions = np.zeros((20_000, 1), dtype=np.int64)
    np.testing.assert_array_equal(corrupt(actions, 0.0, 4, rng), actions)
    freq = np.bincount(corrupt(actions, 1.0, 4, rng).ravel(), minlength=4) / actions.size
    np.testing.assert_allclose(freq, [0.25] * 4, atol=0.02)
    with pytest.raises(ValueError, match="residual=1.5"):
        corrupt(actions, 1.5, 4, rng)


def test_config_reports_all_problems_at_once():
    with pytest.raises(ValueError) as err:
        BanditConfig(num_contexts=5, group_size=1, residual=2.0, probes=("sgt", "ppo"))
    msg = str(err.value)
    for part in ("num_contexts=5", "group_size=1", "residual=2.0", "probes=", "'prp-clip'"):
        assert part in msg


def test_probe_spec_requires_valid_prp_mode():
    with pytest.raises(ValueError, match="is_mode='sqrt'"):
        ProbeSpec("prp-x", "prp", "sqrt")
    with pytest.raises(ValueError, match="kind='ppo'"):
        ProbeSpec("ppo", "ppo")


def test_extra_sgt_lambdas_become_their_own_arms():
    cfg = BanditConfig(probes=("none", "sgt"), sgt_extra_lambdas=(0.5, 1.0))
    assert [p.name for p in cfg.probe_specs] == ["none", "sgt", "sgt@0.5", "sgt@1"]
    assert cfg.probe_specs[3].lambda_sgt == 1.0


def test_peers_are_the_other_family_and_transfers_keep_reward():
    cfg = BanditConfig(num_contexts=4, num_actions=3, group_size=4, peer_samples=2, residual=0.0)
    prob = make_problem(4, 3, seed=0)
    d = draw_samples(prob.init_logits, prob, cfg, np.random.default_rng(0))
    np.testing.assert_array_equal(d.peer_source[0], d.actions[1, :, :2])
    np.testing.assert_array_equal(d.peer_source[1], d.actions[0, :, :2])
    np.testing.assert_array_equal(d.peer_arrived, d.peer_source)
    np.testing.assert_array_equal(d.peer_rewards[0], d.rewards[1, :, :2])


def test_xgrpo_with_alpha_zero_own_scale_is_plain_grpo_on_same_draws():
    """Invariant: the value-level probe switched off is the control arm (docs/probes.md)."""
    cfg = BanditConfig(num_contexts=8, num_actions=5, alpha=0.0, scale_source="own")
    prob = make_problem(8, 5, seed=3)
    a = stochastic_update(PROBE("none"), prob.init_logits, prob, cfg, np.random.default_rng(5))
    b = stochastic_update(PROBE("xgrpo"), prob.init_logits, prob, cfg, np.random.default_rng(5))
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_sgt_weak_variance_comes_from_thl_residual():
    """On weak contexts the own group almost always fails (GRPO part 0) and the peer almost
    always succeeds, so SGT's update there is nearly deterministic without a THL residual."""
    prob = make_problem(16, 8, seed=0)
    clean = BanditConfig(num_contexts=16, num_actions=8, residual=0.0, mc_draws=400)
    noisy = BanditConfig(num_contexts=16, num_actions=8, residual=0.3, mc_draws=400)
    v0 = measure_update(PROBE("sgt"), prob.init_logits, prob, clean, np.random.default_rng(0))
    v1 = measure_update(PROBE("sgt"), prob.init_logits, prob, noisy, np.random.default_rng(0))
    assert v0["variance_weak"] < 0.25 * v1["variance_weak"]
    assert v0["share_lowering_weak"] == 0.0 < v1["share_lowering_weak"]


def test_plain_grpo_expected_update_follows_the_reward_gradient():
    prob = make_problem(16, 8, seed=0)
    cfg = BanditConfig(num_contexts=16, num_actions=8, mc_draws=2000)
    m = measure_update(PROBE("none"), prob.init_logits, prob, cfg, np.random.default_rng(0))
    assert m["cos_to_gradient"] > 0.95
    assert m["share_lowering"] == 0.0  # one correct action: sum(A) = 0 moves mass only onto it
    assert m["variance"] > 0 and m["variance_se"] < 0.1 * m["variance"]
