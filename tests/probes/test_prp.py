"""PRP math (docs/probes.md): weights, pooled advantages and the peer surrogate, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.probes.prp import (
    aggregate_token_losses,
    prp_importance_weights,
    prp_pooled_advantages,
    prp_surrogate_loss,
    prp_token_losses,
    prp_weight_metrics,
)

EPS = 1e-4
E = math.exp

# A 2-policy, 2-prompt example. Receiver i has G = 2 per prompt; peer j offers up to M = 2.
OWN = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
PEER = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
PEER_MASK = torch.tensor([[True, True], [True, False]])  # prompt 1 has only one peer rollout
# The three present peer sequences, flattened (p0 success, p0 fail, p1 success), L = 2.
LOGP_RECV = torch.tensor([[-1.0, -2.0], [-0.3, -0.4], [-0.2, -9.0]])
LOGP_SRC = torch.tensor([[-1.5, -0.5], [-0.3, -1.0], [-1.2, 0.0]])
MASK = torch.tensor([[True, True], [True, True], [True, False]])
# log rho = recv - src = [[0.5, -1.5], [0.0, 0.6], [1.0, (masked)]]


def test_pooled_advantages_by_hand():
    own_adv, peer_adv = prp_pooled_advantages(OWN, PEER, PEER_MASK)
    # Prompt 0: pooled [0, 0, 1, 0]: mean 0.25, Bessel var (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5.
    #   own: (0 - 0.25) / 0.5001 = -0.4999000; peers: 0.75 / 0.5001 = 1.4997001, -0.4999000.
    # Prompt 1: pooled [1, 0, 1] (masked slot left out): mean 2/3, var (1/9 + 4/9 + 1/9) / 2 = 1/3.
    #   std 0.5773503: own 1/3 / 0.5774503 = 0.5772503, -2/3 / 0.5774503 = -1.1545006;
    #   peer 0.5772503, masked slot 0.
    torch.testing.assert_close(own_adv, torch.tensor([[-0.4999000, -0.4999000], [0.5772503, -1.1545006]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(peer_adv, torch.tensor([[1.4997001, -0.4999000], [0.5772503, 0.0]]), rtol=0, atol=1e-6)


def test_pooled_advantages_scale_none_and_batch():
    own_adv, peer_adv = prp_pooled_advantages(OWN, PEER, PEER_MASK, scale_rewards="none")
    # r - group mean: prompt 0 mean 0.25, prompt 1 mean 2/3.
    torch.testing.assert_close(own_adv, torch.tensor([[-0.25, -0.25], [1 / 3, -2 / 3]]))
    torch.testing.assert_close(peer_adv, torch.tensor([[0.75, -0.25], [1 / 3, 0.0]]))
    # batch: one std over the 7 counted rewards [0,0,1,0, 1,0,1]: mean 3/7,
    # Bessel var = (3 * (4/7)^2 + 4 * (3/7)^2) / 6 = (48/49 + 36/49) / 6 = 2/7.
    own_b, _ = prp_pooled_advantages(OWN, PEER, PEER_MASK, scale_rewards="batch")
    torch.testing.assert_close(own_b, own_adv / (math.sqrt(2 / 7) + EPS))


# Three prompts, G = 8, one peer rollout on prompt 2 only. Row 0: eight equal non-binary rewards
# (their float32 mean is not 0.3 itself); row 1: mixed rewards; row 2: one success.
OWN8 = torch.tensor([[0.3] * 8, [0.1, 0.3, 0.7, 0.1, 0.1, 0.3, 0.7, 0.1], [1.0] + [0.0] * 7])
PEER8 = torch.tensor([[0.0], [0.0], [1.0]])
PEER8_MASK = torch.tensor([[False], [False], [True]])


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_prompt_without_peers_keeps_plain_grpo_advantages_bit_for_bit(scale_rewards):
    own_adv, peer_adv = prp_pooled_advantages(OWN8, PEER8, PEER8_MASK, scale_rewards=scale_rewards)
    # Row 0: r - mean is 0 for equal rewards, so plain GRPO gives exactly 0 (the float32 mean of
    # eight 0.3s divided by eps would give ~3e-4).
    assert torch.equal(own_adv[0], torch.zeros(8))
    # Row 1: mean 0.3, centered [-0.2, 0, 0.4, -0.2] twice, Bessel var 8 * 0.06 / 7, and the
    # trainer's group_advantages to the last bit.
    std = math.sqrt(8 * 0.06 / 7) if scale_rewards == "group" else 0.0
    div = std + EPS if scale_rewards == "group" else 1.0
    hand = torch.tensor([-0.2, 0.0, 0.4, -0.2] * 2) / div
    torch.testing.assert_close(own_adv[1], hand, rtol=0, atol=1e-5)
    assert torch.equal(own_adv[:2], group_advantages(OWN8, scale_rewards)[:2])
    # Row 2 is pooled: [1, 0 x 7, 1]: mean 2/9, Bessel var (2 * (7/9)^2 + 7 * (2/9)^2) / 8 = 7/36.
    div = math.sqrt(7 / 36) + EPS if scale_rewards == "group" else 1.0
    torch.testing.assert_close(own_adv[2], torch.tensor([7 / 9] + [-2 / 9] * 7) / div, rtol=0, atol=1e-6)
    torch.testing.assert_close(peer_adv[2], torch.tensor([7 / 9 / div]), rtol=0, atol=1e-6)
    assert torch.equal(peer_adv[:2], torch.zeros(2, 1))


def test_batch_scale_keeps_the_own_batch_std_for_prompts_without_peers():
    own_adv, _ = prp_pooled_advantages(OWN8, PEER8, PEER8_MASK, scale_rewards="batch")
    # Plain GRPO's batch std, over the 24 own rewards: sum 2.4 + 2.4 + 1 = 5.8,
    # sum of squares 0.72 + 1.2 + 1 = 2.92, var = (2.92 - 5.8^2 / 24) / 23.
    own_std = math.sqrt((2.92 - 5.8**2 / 24) / 23)
    hand = torch.tensor([-0.2, 0.0, 0.4, -0.2] * 2) / (own_std + EPS)
    assert torch.equal(own_adv[0], torch.zeros(8))
    torch.testing.assert_close(own_adv[1], hand, rtol=0, atol=1e-5)
    assert torch.equal(own_adv[:2], group_advantages(OWN8, "batch")[:2])
    # The pooled prompt takes the std of the pooled batch, the 24 own rewards and the peer's 1:
    # sum 6.8, sum of squares 3.92, var = (3.92 - 6.8^2 / 25) / 24.
    pooled_std = math.sqrt((3.92 - 6.8**2 / 25) / 24)
    # Row 2 centered by its pooled mean 2/9.
    torch.testing.assert_close(own_adv[2], torch.tensor([7 / 9] + [-2 / 9] * 7) / (pooled_std + EPS),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_pooled_group_of_equal_rewards_gets_exactly_zero(scale_rewards):
    # Eight own 0.3s and a peer's 0.3: nine equal rewards, r - mean = 0 for each (docs/grpo.md).
    own_adv, peer_adv = prp_pooled_advantages(torch.full((1, 8), 0.3), torch.tensor([[0.3]]),
                                              scale_rewards=scale_rewards)
    assert torch.equal(own_adv, torch.zeros(1, 8)) and torch.equal(peer_adv, torch.zeros(1, 1))


def test_truncated_importance_weights_by_hand():
    w = prp_importance_weights(LOGP_RECV, LOGP_SRC, MASK, "truncate", "token", c=1.5)
    # rho = [[e^0.5 = 1.6487, e^-1.5 = 0.2231], [1, e^0.6 = 1.8221], [e^1 = 2.7183, masked]]
    # min(rho, 1.5): three capped; masked token weight 0.
    torch.testing.assert_close(w, torch.tensor([[1.5, E(-1.5)], [1.0, 1.5], [1.5, 0.0]]))
    ws = prp_importance_weights(LOGP_RECV, LOGP_SRC, MASK, "truncate", "sequence", c=1.5)
    # Sequence log rho = sums over counted tokens: [-1.0, 0.6, 1.0] -> [e^-1, min(e^0.6, 1.5), min(e, 1.5)].
    assert ws.shape == (3,)
    torch.testing.assert_close(ws, torch.tensor([E(-1.0), 1.5, 1.5]))


def test_clip_and_none_weights_by_hand():
    wc = prp_importance_weights(LOGP_RECV, LOGP_SRC, MASK, "clip", "token", c=1.5)
    # clamp to [1/1.5, 1.5] = [0.6667, 1.5]: e^-1.5 = 0.2231 is raised to 2/3.
    torch.testing.assert_close(wc, torch.tensor([[1.5, 2 / 3], [1.0, 1.5], [1.5, 0.0]]))
    wn = prp_importance_weights(LOGP_RECV, LOGP_SRC, MASK, "none", "token", c=1.5)
    assert torch.equal(wn, MASK.float())


def test_weights_do_not_overflow_on_long_sequences():
    recv = torch.zeros(1, 2000)
    src = torch.full((1, 2000), -1.0)  # sequence log rho = 2000 nats: e^2000 overflows float32
    w = prp_importance_weights(recv, src, torch.ones(1, 2000, dtype=torch.bool), "truncate", "sequence", c=2.0)
    assert w.tolist() == [2.0]


def test_surrogate_at_first_iteration_by_hand():
    _, peer_adv = prp_pooled_advantages(OWN, PEER, PEER_MASK)
    adv = peer_adv[PEER_MASK]  # [a0, a1, a2] = [1.4997001, -0.4999000, 0.5772503]
    logp_theta = LOGP_RECV.clone().requires_grad_(True)  # r = 1: l_t = -w_t * A
    loss = prp_surrogate_loss(logp_theta, LOGP_RECV, LOGP_SRC, MASK, adv, "truncate", "token", c=1.5,
                              lambda_prp=0.5, loss_type="grpo")
    # Per-sequence means: s0 = -(1.5 + e^-1.5) / 2 * a0 = -1.2920892
    #                     s1 = -(1.0 + 1.5) / 2 * a1   = +0.6248750
    #                     s2 = -1.5 * a2               = -0.8658754
    # loss = 0.5 * (s0 + s1 + s2) / 3 = -0.2555149
    assert loss.item() == pytest.approx(-0.2555149, abs=1e-6)
    loss.backward()
    # d loss / d logp_theta(t) = 0.5 * (-w_t * A) / (tokens in its sequence * 3 sequences).
    a0, a1, a2 = adv.tolist()
    expected = torch.tensor([
        [-1.5 * a0 / 12, -E(-1.5) * a0 / 12],
        [-1.0 * a1 / 12, -1.5 * a1 / 12],
        [-1.5 * a2 / 6, 0.0],
    ])
    torch.testing.assert_close(logp_theta.grad, expected)


def test_surrogate_ppo_clip_stops_gradient_of_positive_advantage_above_range():
    # r = 1.5 on every token (outside 1 +- 0.2). A > 0: min(1.5 A, 1.2 A) = 1.2 A, no gradient;
    # A < 0: min(-1.5, -1.2) * |A| picks the unclipped branch, gradient flows.
    logp_theta = (LOGP_RECV[:2] + math.log(1.5)).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0])
    losses = prp_token_losses(logp_theta, LOGP_RECV[:2], LOGP_RECV[:2], MASK[:2], adv, "none", "token", c=1.0)
    # weights 1: seq 0 -> -1.2 * 2 = -2.4 per token; seq 1 -> -(1.5 * -1) = 1.5 per token.
    torch.testing.assert_close(losses, torch.tensor([[-2.4, -2.4], [1.5, 1.5]]))
    losses.sum().backward()
    torch.testing.assert_close(logp_theta.grad, torch.tensor([[0.0, 0.0], [1.5, 1.5]]))


def test_weight_metrics_by_hand():
    m = prp_weight_metrics(LOGP_RECV, LOGP_SRC, MASK, "truncate", "token", c=1.5)
    # Counted log rho = [0.5, -1.5, 0.0, 0.6, 1.0]; weights [1.5, e^-1.5, 1, 1.5, 1.5].
    assert m["probe/prp_units"] == 5.0
    assert m["probe/prp_log_ratio_mean"] == pytest.approx(0.6 / 5)
    assert m["probe/prp_log_ratio_max"] == pytest.approx(1.0)
    assert m["probe/prp_log_ratio_abs_max"] == pytest.approx(1.5)
    assert m["probe/prp_frac_capped"] == pytest.approx(3 / 5)
    assert m["probe/prp_weight_mean"] == pytest.approx(5.7231302 / 5)
    # ESS / n: (sum w)^2 / sum w^2 / 5 = 5.7231302^2 / 7.7997871 / 5 = 0.8398747
    assert m["probe/prp_ess"] == pytest.approx(0.8398747, abs=1e-6)
    # raw: sum e^lr = 7.4122521, sum e^(2 lr) = 14.4772419 -> 0.7590048
    assert m["probe/prp_ess_raw"] == pytest.approx(0.7590048, abs=1e-6)
    none = prp_weight_metrics(LOGP_RECV, LOGP_SRC, MASK, "none", "sequence", c=1.5)
    assert none["probe/prp_ess"] == 1.0 and none["probe/prp_frac_capped"] == 0.0 and none["probe/prp_units"] == 3.0


def grpo_token_losses(logp_theta, logp_old, adv, eps_clip=0.2):
    """Reference GRPO token loss, docs/grpo.md with beta = 0: -min(r A, clip(r, 1-e, 1+e) A)."""
    r = torch.exp(logp_theta - logp_old)
    a = adv[:, None]
    return -torch.minimum(r * a, r.clamp(1 - eps_clip, 1 + eps_clip) * a)


@pytest.mark.parametrize("is_mode", ["truncate", "clip", "none"])
@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_identical_policies_equal_grpo_with_twice_the_group(is_mode, is_level, loss_type):
    b, g, length = 2, 3, 4
    gen = torch.Generator().manual_seed(7)
    own_r = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    peer_r = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # Same policy, same tokenizer: the peer's sampling log-probs are the receiver's own.
    logp_old = -torch.rand(2 * b * g, length, generator=gen) * 3  # rows: own (B*G), then peers
    mask = torch.ones(2 * b * g, length, dtype=torch.bool)
    mask[1, 3:] = mask[7, 2:] = mask[10, 1:] = False
    logp_theta = (logp_old + 0.3 * torch.randn(2 * b * g, length, generator=gen)).requires_grad_(True)

    # Reference: GRPO with a group of 2G per prompt, sequences ordered own then peer.
    all_r = torch.cat([own_r, peer_r], 1)
    ref_adv = (all_r - all_r.mean(1, keepdim=True)) / (all_r.std(1, keepdim=True) + EPS)
    own_ref_adv, peer_ref_adv = ref_adv[:, :g].reshape(-1), ref_adv[:, g:].reshape(-1)
    ref_losses = grpo_token_losses(logp_theta, logp_old, torch.cat([own_ref_adv, peer_ref_adv]))
    ref_loss = aggregate_token_losses(ref_losses, mask, loss_type)
    (ref_grad,) = torch.autograd.grad(ref_loss, logp_theta)

    own_adv, peer_adv = prp_pooled_advantages(own_r, peer_r)
    torch.testing.assert_close(own_adv.reshape(-1), own_ref_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(peer_adv.reshape(-1), peer_ref_adv, rtol=0, atol=1e-6)
    own, peer = slice(0, b * g), slice(b * g, 2 * b * g)
    w = prp_importance_weights(logp_old[peer], logp_old[peer], mask[peer], is_mode, is_level, c=1.0)
    assert torch.equal(w, torch.ones_like(w) if is_level == "sequence" else mask[peer].float())

    own_loss = aggregate_token_losses(grpo_token_losses(logp_theta[own], logp_old[own], own_adv.reshape(-1)), mask[own], loss_type)
    peer_loss = prp_surrogate_loss(logp_theta[peer], logp_old[peer], logp_old[peer], mask[peer], peer_adv.reshape(-1),
                                   is_mode, is_level, c=1.0, lambda_prp=1.0, loss_type=loss_type)
    # Pooled GRPO = own and peer losses weighted by their share of sequences (grpo) or tokens (dapo).
    if loss_type == "grpo":
        w_own = w_peer = 0.5
    else:
        w_own = mask[own].sum().item() / mask.sum().item()
        w_peer = mask[peer].sum().item() / mask.sum().item()
    combined = w_own * own_loss + w_peer * peer_loss
    torch.testing.assert_close(combined, ref_loss, rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(combined, logp_theta)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-7)


LOSS_TYPE_SETUPS = [  # every loss type of docs/grpo.md at each importance level a config may pair it with
    ("grpo", "token", {}), ("grpo", "sequence", {"epsilon_high": 0.28}), ("bnpo", "token", {}),
    ("dr_grpo", "token", {}), ("dapo", "token", {"delta": 1.3}), ("cispo", "token", {"epsilon_high": 1.1}),
    ("sapo", "token", {"sapo_temperature_pos": 2.0}), ("sapo", "sequence", {}), ("luspo", "sequence", {}),
    ("vespo", "token", {"vespo_lambda_neg": 0.0}),
]


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type, level, options", LOSS_TYPE_SETUPS)
def test_identical_peers_get_the_policys_own_unit_loss_for_every_loss_type(loss_type, level, options, is_level):
    """docs/probes.md: the peer unit loss is the receiver's own loss type's term on the ratio to the receiver;
    for identical peers (log pi_recv = log pi_src, every weight 1) it equals grpo_loss's own per-token loss,
    value and gradient, also once the policy has moved (ratios away from 1, clipped, capped, gated)."""
    from mrl_lightning.objectives.grpo import aggregate_loss, grpo_loss

    gen = torch.Generator().manual_seed(3)
    n, length = 6, 5
    logp_old = -torch.rand(n, length, generator=gen) * 3
    mask = torch.ones(n, length, dtype=torch.bool)
    mask[1, 3:] = mask[4, 1:] = False
    logp_old = torch.where(mask, logp_old, torch.zeros_like(logp_old))
    adv = torch.tensor([1.2, -0.7, 0.0, 2.0, -1.5, 0.4])
    moved = logp_old + 0.4 * torch.randn(n, length, generator=gen)
    epsilon, epsilon_high = 0.2, options.pop("epsilon_high", None)
    theta_own, theta_peer = moved.clone().requires_grad_(True), moved.clone().requires_grad_(True)
    own = grpo_loss(theta_own, logp_old, adv, mask, loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high,
                    importance_sampling_level=level, max_completion_length=length, **options)
    peer = prp_token_losses(theta_peer, logp_old, logp_old, mask, adv, "truncate", is_level, 1.0, epsilon,
                            epsilon_high, loss_type=loss_type, importance_sampling_level=level, **options)
    own_tokens = torch.where(mask, own.per_token_loss, torch.zeros_like(own.per_token_loss))
    torch.testing.assert_close(peer, own_tokens, rtol=0, atol=0)
    own_loss = aggregate_loss(own.per_token_loss, mask, loss_type, length)
    peer_loss = aggregate_token_losses(peer, mask, loss_type, length)
    torch.testing.assert_close(peer_loss, own_loss, rtol=0, atol=0)
    own_loss.backward()
    peer_loss.backward()
    torch.testing.assert_close(theta_peer.grad, theta_own.grad, rtol=0, atol=0)


def test_no_peer_samples_give_zero_loss_with_grad():
    logp = torch.zeros(0, 3, requires_grad=True)
    loss = prp_surrogate_loss(logp, logp.detach(), logp.detach(), torch.zeros(0, 3, dtype=torch.bool), torch.zeros(0))
    assert loss.item() == 0.0 and loss.requires_grad


def test_invalid_weight_arguments_are_all_reported():
    with pytest.raises(ValueError) as err:
        prp_importance_weights(LOGP_RECV, LOGP_SRC[:2], MASK.float(), "cap", "chunk", c=0.0)
    msg = str(err.value)
    for part in ("[M, L] shape", "mask must be bool", "is_mode='cap'", "is_level='chunk'", "c=0.0"):
        assert part in msg


def test_clip_mode_needs_cap_at_least_one():
    with pytest.raises(ValueError, match=r"c=0.5 must be > 0 \(and >= 1 for is_mode='clip'"):
        prp_importance_weights(LOGP_RECV, LOGP_SRC, MASK, "clip", "token", c=0.5)


def test_pooled_advantages_reject_unmasked_nan_and_bad_scale():
    with pytest.raises(ValueError) as err:
        prp_pooled_advantages(OWN, torch.tensor([[float("nan"), 0.0], [1.0, 0.0]]), scale_rewards="rank")
    assert "NaN/inf" in str(err.value) and "scale_rewards='rank'" in str(err.value)
