"""Equivalent micro-batch splits give the same gradients and the same update (docs/grpo.md, "One update").

``policy_update`` splits a step's N sequences into micro-batches whose losses use the
whole step's normalizers (``num_sequences`` / ``num_tokens``), so the summed gradient is
the full-batch gradient for every ``loss_type`` (the GRPO family, GSPO's sequence level),
with KL, with mu > 1 inner iterations, with truncated completions masked, and with the
masks on the policy term (``top_entropy_quantile`` takes its quantile over the whole batch,
not per micro-batch; ``off_policy_mask_threshold``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.builders import build_policy
from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.objectives.grpo import grpo_loss
from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import policy_update
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:"]
G, L = 3, 6
# [B = 2, G = 3], not zero-mean on purpose: the split must not rely on it.
ADVANTAGES = torch.tensor([[1.0, -0.5, -0.25], [0.3, -1.2, 0.9]])

FABRIC = SimpleNamespace(
    backward=lambda loss: loss.backward(),
    clip_gradients=lambda module, optimizer, max_norm: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm),
)


def _policy(folder, micro, **options):
    policy = PolicyModule(name="p", model=str(folder), temperature=0.7, num_generations=G, max_completion_length=L,
                          micro_batch_size=micro, **options)
    build_policy(policy)
    return policy


@pytest.fixture(scope="module")
def rollout(invariant_lm_dir):
    policy = _policy(invariant_lm_dir, None)
    torch.manual_seed(6)
    out = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                      num_generations=G, max_completion_length=L, temperature=0.7)
    # Rows of different counted lengths and both finish reasons make the split non-trivial.
    assert len(set(out.completion_mask.sum(1).tolist())) > 1
    assert set(out.finish_reasons) == {"stop", "length"}
    return out


def _update(folder, rollout, micro, **options):
    policy = _policy(folder, micro, **options)
    before = [p.detach().clone() for p in policy.model.parameters()]
    # Plain SGD: the update is linear in the gradient. (With AdamW's first step, g / (|g| + 1e-8),
    # float noise on a gradient that is exactly 0 in theory - the attention key bias - turns
    # into a +-lr step whose sign is noise, so parameters after AdamW are not comparable.)
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    batch = TrainBatch(scored=SimpleNamespace(rollouts=rollout), advantages=ADVANTAGES.clone())
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    grads = [p.grad.detach().clone() for p in policy.model.parameters()]
    params = [p.detach().clone() for p in policy.model.parameters()]
    return metrics, grads, params, before


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo"),
        dict(loss_type="bnpo"),
        dict(loss_type="grpo"),
        dict(loss_type="dr_grpo"),
        dict(loss_type="dapo", beta=0.1, num_iterations=2),
        dict(loss_type="grpo", mask_truncated_completions=True, num_iterations=2, max_grad_norm=None),
        dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1, num_iterations=2),
        dict(loss_type="luspo", importance_sampling_level="sequence", num_iterations=2),
        dict(loss_type="cispo", epsilon_high=5.0, num_iterations=2),
        dict(loss_type="sapo", num_iterations=2, beta=0.1),
        dict(loss_type="vespo", num_iterations=2),
        dict(loss_type="dapo", top_entropy_quantile=0.5, num_iterations=2),
        dict(loss_type="dapo", delta=1.5, off_policy_mask_threshold=0.01, num_iterations=2),
    ],
    ids=["dapo", "bnpo", "grpo", "dr_grpo", "dapo-kl-mu2", "grpo-masktrunc-mu2", "gspo-kl-mu2", "luspo-mu2",
         "cispo-mu2", "sapo-kl-mu2", "vespo-mu2", "dapo-top-entropy-mu2", "dapo-delta-opsm-mu2"],
)
@pytest.mark.parametrize("micro", [2, 4])
def test_micro_batches_give_the_full_batch_gradient_and_update(invariant_lm_dir, rollout, options, micro):
    full_metrics, full_grads, full_params, before = _update(invariant_lm_dir, rollout, None, **options)
    split_metrics, split_grads, split_params, _ = _update(invariant_lm_dir, rollout, micro, **options)
    assert set(split_metrics) == set(full_metrics)
    for tag in full_metrics:  # the loss types' own statistics too (cispo_clip_ratio, vespo/phi_seq_mean, masks)
        if not tag.endswith("_time_s"):
            assert split_metrics[tag] == pytest.approx(full_metrics[tag], rel=1e-4, abs=1e-6, nan_ok=True), tag
    # The test has something to compare: a non-zero gradient and parameters that moved.
    assert sum(float(g.abs().sum()) for g in full_grads) > 1e-3
    assert any(not torch.equal(a, b) for a, b in zip(full_params, before))
    for g_full, g_split in zip(full_grads, split_grads):
        torch.testing.assert_close(g_split, g_full, rtol=1e-4, atol=1e-6)
    for p_full, p_split in zip(full_params, split_params):
        torch.testing.assert_close(p_split, p_full, rtol=1e-4, atol=1e-6)
    assert split_metrics["train/p/loss"] == pytest.approx(full_metrics["train/p/loss"], rel=1e-4, abs=1e-6)
    assert split_metrics["train/p/grad_norm"] == pytest.approx(full_metrics["train/p/grad_norm"], rel=1e-4)


def test_averaging_micro_batch_losses_would_not_be_invariant(invariant_lm_dir, rollout):
    """Why the whole-batch normalizers matter: with per-micro-batch token counts the loss changes."""
    policy = _policy(invariant_lm_dir, None)
    r, m = rollout, rollout.completion_mask
    with torch.no_grad():
        logp, _ = policy.completion_logprobs(r.prompt_ids, r.prompt_mask, r.completion_ids, m)
    old = logp - 0.05  # a ratio away from 1 so every token contributes
    adv = ADVANTAGES.reshape(-1)
    full = float(grpo_loss(logp, old, adv, m, loss_type="dapo").loss)
    slices = [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert len({int(m[s].sum()) for s in slices}) > 1  # micro-batches hold different token counts
    naive = sum(float(grpo_loss(logp[s], old[s], adv[s], m[s], loss_type="dapo").loss) for s in slices) / 3
    shared = sum(float(grpo_loss(logp[s], old[s], adv[s], m[s], loss_type="dapo", num_sequences=6,
                                 num_tokens=float(m.sum())).loss) for s in slices)
    assert shared == pytest.approx(full, abs=1e-6)
    assert abs(naive - full) > 1e-3


@pytest.mark.parametrize("options", [dict(), dict(beta=0.1, top_entropy_quantile=0.5, micro_batch_size=2)])
def test_a_rank_with_no_kept_group_holds_a_zero_gradient(invariant_lm_dir, rollout, options):
    """Dynamic sampling can leave a rank (or a step) with no GRPO row: the update runs, on a zero gradient,
    as the rank's share of a group's summed gradient must be."""
    micro = options.pop("micro_batch_size", None)
    policy = _policy(invariant_lm_dir, micro, **options)
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    empty = rollout.select_rows([])
    batch = TrainBatch(scored=SimpleNamespace(rollouts=empty), advantages=torch.zeros(0, G))
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    assert all(p.grad is not None and not p.grad.any() for p in policy.model.parameters())
    assert metrics["train/p/loss"] == 0.0 and metrics["train/p/grad_norm"] == 0.0
