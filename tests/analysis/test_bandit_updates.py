"""Hand-computed cases of the per-probe bandit updates (docs/bandit.md, docs/probes.md).

Receiver in every case: one context, two actions, ``pi = [0.2, 0.8]``, so
``grad log pi(0) = e0 - pi = [0.8, -0.8]`` and ``grad log pi(1) = e1 - pi = [-0.2, 0.2]``.
Stds are Bessel-corrected and ``eps = 1e-4`` (TRL's numbers).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mrl_lightning.analysis.updates import (
    ADV_EPS,
    group_advantages,
    grpo_update,
    importance_weights,
    prp_update,
    score_direction,
    sgt_update,
    xgrpo_update,
)

PI = np.array([[0.2, 0.8]])  # [N=1, K=2]
# Two rewards {1, 0}: mean 0.5, Bessel std sqrt(0.5) -> |A| = 0.5 / (sqrt(0.5) + eps).
A2 = 0.5 / (math.sqrt(0.5) + ADV_EPS)
# Four rewards {0, 0, 1, 1}: mean 0.5, Bessel std sqrt(1/3) -> |A| = 0.5 / (sqrt(1/3) + eps).
A4 = 0.5 / (math.sqrt(1 / 3) + ADV_EPS)


def test_group_advantages_match_spec2_group_scaling():
    adv = group_advantages(np.array([[1.0, 0.0]]))
    np.testing.assert_allclose(adv, [[A2, -A2]], rtol=1e-12)


def test_zero_variance_group_gets_zero_advantage():
    np.testing.assert_array_equal(group_advantages(np.zeros((1, 4))), np.zeros((1, 4)))
    np.testing.assert_array_equal(group_advantages(np.ones((1, 4))), np.zeros((1, 4)))


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(np.ones((1, 1)))


def test_score_direction_sums_coefficients_times_score():
    # 1 * (e0 - pi) + 2 * (e0 - pi) = 3 * [0.8, -0.8]
    out = score_direction(PI, np.array([[0, 0]]), np.array([[1.0, 2.0]]))
    np.testing.assert_allclose(out, [[2.4, -2.4]])


def test_grpo_update_pushes_success_up_and_failure_down():
    # (1/2) * (A2 * [0.8, -0.8] - A2 * [-0.2, 0.2]) = A2/2 * [1, -1]
    out = grpo_update(PI, np.array([[0, 1]]), np.array([[1.0, 0.0]]))
    np.testing.assert_allclose(out, [[A2 / 2, -A2 / 2]], rtol=1e-12)


def test_grpo_update_is_zero_on_all_fail_group():
    out = grpo_update(PI, np.array([[1, 1]]), np.array([[0.0, 0.0]]))
    np.testing.assert_array_equal(out, np.zeros((1, 2)))


@pytest.mark.parametrize(
    ("mode", "rho", "expected"),
    [("truncate", 0.125, 0.125), ("truncate", 4.0, 2.0), ("clip", 0.125, 0.5), ("clip", 4.0, 2.0),
     ("clip", 1.5, 1.5), ("none", 0.125, 1.0), ("none", 4.0, 1.0)],
)
def test_importance_weight_modes_of_spec32(mode, rho, expected):
    w = importance_weights(np.array([math.log(rho)]), np.array([0.0]), mode, cap=2.0)
    np.testing.assert_allclose(w, [expected], rtol=1e-12)


def test_importance_weight_rejects_unknown_mode_and_small_cap():
    with pytest.raises(ValueError, match=r"is_mode='sqrt'.*valid: \['clip', 'none', 'truncate'\]"):
        importance_weights(np.zeros(1), np.zeros(1), "sqrt", cap=2.0)
    with pytest.raises(ValueError, match="cap=1.0 must be > 1"):
        importance_weights(np.zeros(1), np.zeros(1), "clip", cap=1.0)


@pytest.mark.parametrize(("mode", "w"), [("truncate", 0.2 / 0.9), ("clip", 0.5), ("none", 1.0)])
def test_prp_pools_peer_successes_with_mode_weight(mode, w):
    """Own [1, 1] fail, peer [0, 0] succeed, sampled by the peer at 0.9: rho = 0.2 / 0.9.

    Pooled rewards [0, 0, 1, 1]: own A = -A4, peer A = +A4. Then
    U = (1/4) * (2 * -A4 * [-0.2, 0.2] + 2 * w * A4 * [0.8, -0.8]) = A4/2 * (0.2 + 0.8 w) * [1, -1].
    """
    out = prp_update(
        PI, np.array([[1, 1]]), np.array([[0.0, 0.0]]), np.array([[0, 0]]), np.array([[1.0, 1.0]]),
        np.log(np.array([[0.9, 0.9]])), is_mode=mode, cap=2.0,
    )
    v = A4 / 2 * (0.2 + 0.8 * w)
    np.testing.assert_allclose(out, [[v, -v]], rtol=1e-10)


def test_prp_with_zero_peer_weight_keeps_only_pooled_own_term():
    out = prp_update(
        PI, np.array([[1, 1]]), np.array([[0.0, 0.0]]), np.array([[0, 0]]), np.array([[1.0, 1.0]]),
        np.log(np.array([[0.9, 0.9]])), is_mode="none", cap=2.0, lambda_prp=0.0,
    )
    np.testing.assert_allclose(out, [[A4 / 2 * 0.2, -A4 / 2 * 0.2]], rtol=1e-10)


def test_xgrpo_all_fail_group_gets_negative_advantage_from_peers():
    """Own [0, 0], peers [1, 1], alpha 0.5: b = 0.25, s = sqrt(1/3), A = -0.25 / (s + eps).

    U = (1/2) * 2 * A * (e1 - pi) = A * [-0.2, 0.2]; plain GRPO gives 0 here.
    """
    a = -0.25 / (math.sqrt(1 / 3) + ADV_EPS)
    out = xgrpo_update(PI, np.array([[1, 1]]), np.array([[0.0, 0.0]]), np.array([[1.0, 1.0]]), alpha=0.5)
    np.testing.assert_allclose(out, [[-0.2 * a, 0.2 * a]], rtol=1e-10)
    assert a < 0


def test_xgrpo_all_success_group_gets_positive_advantage_when_peers_fail():
    a = 0.25 / (math.sqrt(1 / 3) + ADV_EPS)  # b = 0.75
    out = xgrpo_update(PI, np.array([[0, 0]]), np.array([[1.0, 1.0]]), np.array([[0.0, 0.0]]), alpha=0.5)
    np.testing.assert_allclose(out, [[0.8 * a, -0.8 * a]], rtol=1e-10)


def test_xgrpo_with_alpha_zero_and_own_scale_equals_grpo():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), size=(3, 4))
    actions = rng.integers(0, 5, size=(3, 4, 6))
    rewards = rng.integers(0, 2, size=(3, 4, 6)).astype(float)
    peer = rng.integers(0, 2, size=(3, 4, 6)).astype(float)
    np.testing.assert_allclose(
        xgrpo_update(probs, actions, rewards, peer, alpha=0.0, scale_source="own"),
        grpo_update(probs, actions, rewards), rtol=1e-12)


def test_xgrpo_rejects_bad_alpha_and_scale_source():
    with pytest.raises(ValueError, match="alpha=1.5"):
        xgrpo_update(PI, np.array([[0, 1]]), np.ones((1, 2)), np.ones((1, 2)), alpha=1.5)
    with pytest.raises(ValueError, match="scale_source='peer'"):
        xgrpo_update(PI, np.array([[0, 1]]), np.ones((1, 2)), np.ones((1, 2)), alpha=0.5, scale_source="peer")


def _sgt(own_a, own_r, src, arrived, peer_r, probs=PI, **kw):
    kw.setdefault("lambda_sgt", 0.1)
    return sgt_update(probs, np.array([own_a]), np.array([own_r], float), np.array([src]),
                      np.array([arrived]), np.array([peer_r], float), **kw)


def test_sgt_rescues_all_fail_context_with_peer_success():
    # GRPO part 0 (all fail); one demo (dedup of [0, 0]): 0.1 * (e0 - pi) = [0.08, -0.08]
    np.testing.assert_allclose(_sgt([1, 1], [0, 0], [0, 0], [0, 0], [1, 1]), [[0.08, -0.08]])


def test_sgt_gate_closed_when_own_group_succeeds_or_peer_fails():
    np.testing.assert_allclose(_sgt([0, 1], [1, 0], [0, 0], [0, 0], [1, 1]), [[A2 / 2, -A2 / 2]], rtol=1e-12)
    np.testing.assert_array_equal(_sgt([1, 1], [0, 0], [1, 1], [1, 1], [0, 0]), np.zeros((1, 2)))


def test_sgt_kappa_opens_gate_for_half_solved_context():
    out = _sgt([0, 1], [1, 0], [0, 0], [0, 0], [1, 1], kappa=0.5)
    np.testing.assert_allclose(out, [[A2 / 2 + 0.08, -A2 / 2 - 0.08]], rtol=1e-12)


def test_sgt_transfers_corrupted_demo_as_it_arrived():
    # The success was action 0 at the source but arrives as action 1: 0.1 * (e1 - pi).
    np.testing.assert_allclose(_sgt([1, 1], [0, 0], [0, 0], [1, 0], [1, 1]), [[-0.02, 0.02]])


def test_sgt_deduplicates_by_source_action_and_caps_demos():
    probs = np.array([[0.5, 0.3, 0.2]])
    e = np.eye(3)
    # Successes at source actions [0, 0, 2]: distinct demos 0 and 2, each weight 0.1 / 2.
    two = _sgt([1, 1], [0, 0], [0, 0, 2], [0, 0, 2], [1, 1, 1], probs=probs, max_demos=2)
    np.testing.assert_allclose(two, 0.05 * ((e[0] - probs) + (e[2] - probs)))
    one = _sgt([1, 1], [0, 0], [0, 0, 2], [0, 0, 2], [1, 1, 1], probs=probs, max_demos=1)
    np.testing.assert_allclose(one, 0.1 * (e[0] - probs))


def test_sgt_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_demos=0"):
        _sgt([1, 1], [0, 0], [0, 0], [0, 0], [1, 1], max_demos=0)
    with pytest.raises(ValueError, match="kappa=2"):
        _sgt([1, 1], [0, 0], [0, 0], [0, 0], [1, 1], kappa=2)
