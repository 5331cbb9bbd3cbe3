"""Each loss type of the GRPO family, GSPO's sequence ratio and the masks, worked out by hand (docs/grpo.md).

The running example of test_grpo_loss.py: N = 2 sequences x L = 3 tokens,

    ratio = [[1.5, 0.7, 1.1],      A = +1
             [0.5, 5.0, 1.3]]      A = -2     mask [[1, 1, 1], [1, 0, 1]]

so 5 tokens are counted; log pi_old = OLD and log pi_theta = OLD + log(ratio).
"""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.objectives.grpo import AGGREGATIONS, grpo_loss
from mrl_lightning.objectives.loss_types import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    OPTION_DEFAULTS,
    build_loss_type,
    importance_weights,
)
from mrl_lightning.objectives.masks import entropy_threshold, high_entropy_mask, off_policy_sequence_mask

RATIO = torch.tensor([[1.5, 0.7, 1.1], [0.5, 5.0, 1.3]])
MASK = torch.tensor([[True, True, True], [True, False, True]])
ADV = torch.tensor([1.0, -2.0])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]])


def _logp(ratio=RATIO):
    return (OLD + ratio.log()).clone().requires_grad_(True)


def test_registry_holds_trl_eight_loss_types_each_with_its_aggregation_and_levels():
    assert list(LOSS_TYPES) == ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
    for name, cls in LOSS_TYPES.items():
        assert cls.name == name and cls.__doc__
        assert cls.aggregation in AGGREGATIONS
        assert set(cls.levels) <= set(IMPORTANCE_SAMPLING_LEVELS)
        assert set(cls.reads()) <= set(OPTION_DEFAULTS)
    with pytest.raises(ValueError, match=r"loss_type='ppo' is not supported; valid: \['grpo'"):
        build_loss_type("ppo")
    with pytest.raises(ValueError, match="unknown loss option"):
        build_loss_type("grpo", sapo_temperature=1.0)


def test_sequence_level_ratio_is_the_exponential_of_the_mean_counted_log_ratio():
    log_ratio = torch.tensor([[0.1, 0.2, 0.0], [-0.2, 5.0, -0.4]])
    w = importance_weights(log_ratio, MASK, "sequence")
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.1)], [math.exp(-0.3)]]))
    torch.testing.assert_close(importance_weights(log_ratio, MASK, "token"), log_ratio.exp())
    with pytest.raises(ValueError, match="importance_sampling_level='seq'"):
        importance_weights(log_ratio, MASK, "seq")


# GSPO (grpo at sequence level): row 0 w = e^0.1 = 1.105171 inside [0.8, 1.28], A = +1: row loss -w,
# d/d logp_t = -w / (3 tokens * 2 sequences); row 1 w = e^-0.3 = 0.740818 < 0.8 with A = -2: clipped,
# -min(-1.4816, -1.6) = 1.6, no gradient. Loss (-1.105171 + 1.6) / 2 = 0.247414.
# LUSPO sums the row instead of averaging it: (3 * -1.105171 + 2 * 1.6) / 2 = -0.057757.
LOG_RATIO = torch.tensor([[0.1, 0.2, 0.0], [-0.2, 5.0, -0.4]])


@pytest.mark.parametrize("loss_type, loss, grad_row0", [("grpo", 0.247414, -math.exp(0.1) / 6),
                                                        ("luspo", -0.057757, -math.exp(0.1) / 2)])
def test_gspo_and_luspo_by_hand(loss_type, loss, grad_row0):
    logp = (OLD + LOG_RATIO).clone().requires_grad_(True)
    out = grpo_loss(logp, OLD, ADV, MASK, loss_type=loss_type, importance_sampling_level="sequence",
                    epsilon=0.2, epsilon_high=0.28)
    assert float(out.loss.detach()) == pytest.approx(loss, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[grad_row0] * 3, [0.0, 0.0, 0.0]]), rtol=0, atol=1e-6)
    assert out.stats["clip_ratio_low"].tolist() == [[False], [True]]  # one value per sequence, as TRL logs it


def test_cispo_caps_the_detached_weight_and_keeps_every_token_gradient():
    # weights min(ratio, 1.28) = [[1.28, 0.7, 1.1], [0.5, -, 1.28]]; l = -w A logp; grad = -w A / 5
    logp = _logp()
    out = grpo_loss(logp, OLD, ADV, MASK, loss_type="cispo", epsilon_high=1.28)
    w = torch.tensor([[1.28, 0.7, 1.1], [0.5, 1.28, 1.28]])
    expected = float(((-w * ADV.unsqueeze(1) * logp.detach()) * MASK).sum() / 5)
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.256, -0.14, -0.22], [0.2, 0.0, 0.512]]), rtol=0,
                               atol=1e-6)
    # clipped where w > cap with A > 0: token [0, 0] only (TRL's cispo_clip_ratio)
    assert (out.stats["cispo_clip_ratio"] & MASK).tolist() == [[True, False, False], [False, False, False]]
    assert not out.clipped_low.any() and not out.clipped_high.any()


def test_sapo_gate_by_hand_and_its_on_policy_gradient_is_the_plain_surrogate():
    # token [0, 0]: w = 1.5, A = +1, tau_pos = 1: -sigmoid(0.5) * 4 = -2.489837
    out = grpo_loss(_logp(), OLD, ADV, MASK, loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    assert float(out.per_token_loss[0, 0]) == pytest.approx(-4 / (1 + math.exp(-0.5)), abs=1e-6)
    # token [1, 0]: w = 0.5, A = -2, tau_neg = 2: sigmoid(-1) * 4 / 2 * 2 = 1.075766
    assert float(out.per_token_loss[1, 0]) == pytest.approx(4 / (1 + math.e), abs=1e-6)
    # at w = 1 the gate's slope is 4 sigmoid'(0) = 1 for any tau: the same gradient as grpo's surrogate
    ones = torch.ones_like(RATIO)
    grads = []
    for loss_type, extra in (("sapo", dict(sapo_temperature_pos=3.0, sapo_temperature_neg=0.5)), ("grpo", {})):
        logp = _logp(ones)
        grpo_loss(logp, OLD, ADV, MASK, loss_type=loss_type, **extra).loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_vespo_gamma_weight_by_hand():
    # row 0: log W = log 1.5 + log 0.7 + log 1.1 = log 1.155, A >= 0: phi = exp(3 + 2 log W - 3 W)
    # row 1: log W = log 0.5 + log 1.3 (the masked 5.0 left out), A < 0: phi = exp(2 + 3 log W - 2 W)
    logp = _logp()
    out = grpo_loss(logp, OLD, ADV, MASK, loss_type="vespo")
    w0, w1 = 1.5 * 0.7 * 1.1, 0.5 * 1.3
    phi = [math.exp(3 + 2 * math.log(w0) - 3 * w0), math.exp(2 + 3 * math.log(w1) - 2 * w1)]
    torch.testing.assert_close(out.stats["vespo/phi_seq_mean"], torch.tensor([[phi[0]], [phi[1]]]))
    out.loss.backward()  # phi is a constant: d/d logp_t = -phi A / 5 on counted tokens
    expected = torch.tensor([[-phi[0] / 5] * 3, [2 * phi[1] / 5, 0.0, 2 * phi[1] / 5]])
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-6)


def test_vespo_weight_is_one_on_policy_and_takes_the_sampler_weights_in():
    ones = torch.ones_like(RATIO)
    out = grpo_loss(_logp(ones), OLD, ADV, MASK, loss_type="vespo")
    torch.testing.assert_close(out.stats["vespo/phi_seq_mean"], torch.ones(2, 1))
    # a sampler weight of 2 on token [0, 0] makes W = 2 for row 0: phi = exp(3 + 2 log 2 - 6) = 4 e^-3
    weights = torch.ones(2, 3)
    weights[0, 0] = 2.0
    out = grpo_loss(_logp(ones), OLD, ADV, MASK, loss_type="vespo", sampler_weights=weights)
    assert float(out.stats["vespo/phi_seq_mean"][0]) == pytest.approx(4 * math.exp(-3), rel=1e-6)
    assert float(out.per_token_loss[0, 0]) == pytest.approx(-4 * math.exp(-3) * float(OLD[0, 0]), rel=1e-6)


def test_delta_caps_the_unclipped_branch_of_a_negative_advantage():
    # token [1, 1] unmasked: ratio 5, A = -2: -min(-10, -2.56) = 10 without delta, -min(-6, -2.56) = 6 with delta 3
    full = torch.ones_like(MASK)
    plain = grpo_loss(_logp(), OLD, ADV, full, loss_type="dapo", epsilon_high=0.28)
    capped = grpo_loss(_logp(), OLD, ADV, full, loss_type="dapo", epsilon_high=0.28, delta=3.0)
    assert float(plain.per_token_loss[1, 1]) == pytest.approx(10.0)
    assert float(capped.per_token_loss[1, 1]) == pytest.approx(6.0)
    assert torch.equal(plain.per_token_loss[0], capped.per_token_loss[0])  # ratios below 3 are untouched
    capped_logp = _logp()
    grpo_loss(capped_logp, OLD, ADV, full, loss_type="dapo", epsilon_high=0.28, delta=3.0).loss.backward()
    assert float(capped_logp.grad[1, 1]) == 0.0  # the cap is a constant: no gradient pushes the ratio further


def test_off_policy_mask_drops_only_negative_advantage_sequences_far_from_the_sampler():
    logp = torch.zeros(3, 2)
    sampler = torch.tensor([[0.3, 0.5], [0.3, 0.5], [0.1, 0.1]])  # mean KL 0.4, 0.4, 0.1
    adv = torch.tensor([[1.0], [-1.0], [-1.0]])
    keep = off_policy_sequence_mask(adv, logp, sampler, torch.ones(3, 2, dtype=torch.bool), threshold=0.2)
    assert keep.tolist() == [[1.0], [0.0], [1.0]]
    out = grpo_loss(logp.requires_grad_(True), logp.detach(), adv.squeeze(1), torch.ones(3, 2, dtype=torch.bool),
                    off_policy_mask_threshold=0.2, sampling_logp=sampler)
    assert out.per_token_loss[1].tolist() == [0.0, 0.0] and out.off_policy_mask.tolist() == keep.tolist()


def test_top_entropy_mask_keeps_the_tokens_at_or_above_the_quantile():
    ent = torch.tensor([[0.1, 0.9, 0.5], [0.7, 9.0, 0.3]])
    counted = ent[MASK]  # 0.1, 0.9, 0.5, 0.7, 0.3: the 0.6 quantile (top 40%) interpolates to 0.58
    threshold = entropy_threshold(counted, 0.4)
    assert float(threshold) == pytest.approx(0.58)
    assert high_entropy_mask(ent, MASK, threshold).tolist() == [[False, True, False], [True, False, False]]
    assert not high_entropy_mask(ent, MASK, entropy_threshold(counted[:0], 0.4)).any()
    with pytest.raises(ValueError, match="top_entropy_quantile=1.5"):
        entropy_threshold(counted, 1.5)
