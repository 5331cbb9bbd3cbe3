"""SGT's bound holds on every step, whatever GRPO's gradient does (docs/probes.md, "Bound").

Many steps of one tiny policy with the real SGT callback: the GRPO advantages are scaled
step by step so that GRPO's gradient weakens, vanishes (every group tied: no signal) and
returns, and the bound itself moves (a schedule). At every step the gradient reaching the
optimizer is captured and split by hand into g_grpo (the same batch and weights without the
transfer) and the rest, and the share of the transfer in the update *applied* is checked
against the bound and against the share the update logged. The weights move between steps
(SGD on the captured gradient), so no two steps see the same gradients.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.data.items import PromptItem
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.exchange.buffer import ExperienceExchange
from mrl_lightning.update.policy_update import loss_counts, policy_update

from test_sgt_grad_share import ADVANTAGES, FABRIC, G, PROMPTS, _Capture, _policy, lm_dir  # noqa: F401

# GRPO's signal per step: full, weaker, nearly gone, gone (twice), back, stronger than at first
SCALES = [1.0, 0.25, 0.02, 0.0, 0.0, 1.0, 4.0, 0.5]
ITEMS = [PromptItem("p0", "1 + 2", "3", "add", {}), PromptItem("p1", "7 - 5", "2", "sub", {})]
SUCCESS = torch.tensor([[True, False, False], [False, False, False]])


SYSTEM = SimpleNamespace(score=lambda texts, items: (None, torch.ones(len(texts)), None))  # group mode's scoring


def _batch(policy, rollouts, scale: float) -> TrainBatch:
    scored = SimpleNamespace(items=ITEMS, success=SUCCESS, prompt_texts=PROMPTS, rollouts=rollouts,
                             rewards=ADVANTAGES.clone() * scale,
                             own_prompt_ids=lambda b: rollouts.prompt_ids[b * G][rollouts.prompt_mask[b * G]].tolist())
    return TrainBatch(scored=scored, advantages=ADVANTAGES.clone() * scale, counts=loss_counts(policy, rollouts))


def _steps(lm_dir, probe: SuccessGatedTransfer):
    """Per step: (bound, logged metrics, ||g_grpo||, ||transfer part of the applied gradient||)."""
    policy, rollouts = _policy(lm_dir)
    out = []
    for step, scale in enumerate(SCALES):
        batch = _batch(policy, rollouts, scale)
        exchange = ExperienceExchange()
        exchange.publish([SuccessRecord(prompt_id="p1", source="peer", step=step, completion_text=" 2", reward=1.0,
                                        verifier="rg_exact", verifier_version="test")])
        # the loop has counted the step's rollout phase before its compose: rollout_step is 1 at the first step
        probe.on_compose_batch(SimpleNamespace(exchange=exchange, rollout_step=step + 1), SYSTEM, policy, batch)
        # g_grpo: the composed batch (group mode rewrites advantages and normalizers) without its transfer term
        plain = _Capture(policy.model.parameters())
        policy_update(policy, TrainBatch(batch.scored, batch.advantages.clone(), counts=dict(batch.counts)),
                      policy.model, FABRIC, plain)
        applied = _Capture(policy.model.parameters())
        metrics = policy_update(policy, batch, policy.model, FABRIC, applied)
        metrics.update(batch.metrics)
        out.append((metrics.get("probe/sgt/me/grad_share_bound"), metrics, float(plain.grads.norm()),
                    float((applied.grads - plain.grads).norm())))
        with torch.no_grad():  # move the weights: the next step's gradients are new
            offset = 0
            for p in policy.model.parameters():
                p -= 0.05 * applied.grads[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
    return out


def test_the_transfer_share_of_the_applied_update_is_within_the_bound_on_every_step(lm_dir):
    probe = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.2, max_grad_share_final=0.5,
                                 max_grad_share_ramp_steps=len(SCALES) - 1)
    steps = _steps(lm_dir, probe)
    bounds = [bound for bound, *_ in steps]
    assert bounds == pytest.approx([0.2 + 0.3 * k / (len(SCALES) - 1) for k in range(len(SCALES))])
    for k, (bound, metrics, grpo, transfer) in enumerate(steps):
        actual = transfer / (grpo + transfer) if grpo + transfer > 0 else 0.0
        assert actual <= bound + 1e-6, f"step {k}: applied share {actual} above the bound {bound}"
        assert metrics["probe/sgt/me/grad_share"] == pytest.approx(actual, abs=1e-5), f"step {k}"
        assert metrics["probe/sgt/me/grad_share_max"] == metrics["probe/sgt/me/grad_share"]
        assert metrics["probe/sgt/me/grpo_grad_norm"] == pytest.approx(grpo, rel=1e-4, abs=1e-7)
        if SCALES[k] == 0.0:  # no GRPO signal: strict, no transfer at all
            assert grpo == 0.0 and transfer == 0.0 and metrics["probe/sgt/me/grad_scale"] == 0.0
        elif SCALES[k] >= 0.25:  # lambda 50 dwarfs GRPO: the bound binds, the share sits on it
            assert metrics["probe/sgt/me/grad_share_raw"] > bound
            assert actual == pytest.approx(bound, abs=1e-5), f"step {k}"


def test_a_floor_lets_a_step_without_grpo_signal_transfer_at_the_floors_size(lm_dir):
    floor = 0.5
    steps = _steps(lm_dir, SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.2, grad_share_floor=floor))
    for k, (bound, metrics, grpo, transfer) in enumerate(steps):
        reference = max(grpo, floor)
        assert transfer / (reference + transfer) <= bound + 1e-6, f"step {k}"
        assert metrics["probe/sgt/me/grad_share_floor_active"] == float(grpo < floor)
        actual = transfer / (grpo + transfer) if grpo + transfer > 0 else 0.0
        assert metrics["probe/sgt/me/grad_share"] == pytest.approx(actual, abs=1e-5)  # the applied share, as it is
    silent = [k for k, s in enumerate(SCALES) if s == 0.0]
    for k in silent:  # tied groups: the transfer still moves the policy, by b / (1 - b) * floor
        _, metrics, grpo, transfer = steps[k]
        assert grpo == 0.0 and transfer == pytest.approx(0.2 / 0.8 * floor, rel=1e-4)
        assert metrics["probe/sgt/me/grad_share"] == pytest.approx(1.0)


@pytest.mark.parametrize("floor", [-0.1, float("nan")])
def test_a_negative_floor_is_a_config_error(floor):
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="grad_share_floor=.* must be >= 0"):
        SuccessGatedTransfer(max_grad_share=0.3, grad_share_floor=floor)


def test_a_floor_without_a_bound_is_a_config_error():
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="grad_share_floor is set but max_grad_share is null"):
        SuccessGatedTransfer(grad_share_floor=0.5)


def test_group_mode_with_a_bound_is_a_config_error():
    """In group mode the demos rewrite their group's own advantages: part of the transfer is inside g_grpo."""
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="transfer_mode='group' with max_grad_share=0.3: .* no share of the update"):
        SuccessGatedTransfer(max_grad_share=0.3, transfer_mode="group")
    SuccessGatedTransfer(transfer_mode="group")  # unbounded group mode stays


def test_group_mode_for_a_receiver_with_dynamic_sampling_is_a_config_error():
    probe = SuccessGatedTransfer(transfer_mode="group")
    system = SimpleNamespace(policies={"a": SimpleNamespace(filter_groups=True), "b": SimpleNamespace(filter_groups=False)})
    errors = probe.config_errors(SimpleNamespace(callbacks=[probe]), system)
    assert len(errors) == 1 and "policy 'a' has filter_groups: true" in errors[0], errors
    assert SuccessGatedTransfer().config_errors(SimpleNamespace(callbacks=[]), system) == []
