"""SGT's ``measure_share_every_n_steps``: fused steps reuse the last measured factor (docs/probes.md, "Cost").

The hand-made batch of ``test_sgt_grad_share``: a measured step records the bound's factor,
a fused step on the same weights and batch must then hand the optimizer the same gradient
(``g_0 + s g_k``) from one shared forward and backward, and the schedule of measured and
fused steps must follow k, survive a checkpoint, and stay off on a policy with several ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.batch import TrainBatch
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.exchange.buffer import ExperienceExchange
from mrl_lightning.update import policy_update

from test_sgt_grad_share import ADVANTAGES, FABRIC, G, PROMPTS, _Capture, _policy, lm_dir  # noqa: F401


def _step(policy, rollouts, probe, step: int, text: str = " 2", workers=None):
    """One composed batch at rollout step ``step`` and its update; the optimizer's gradient and metrics."""
    items = [PromptItem("p0", "1 + 2", "3", "add", {}), PromptItem("p1", "7 - 5", "2", "sub", {})]
    success = torch.tensor([[True, False, False], [False, False, False]])
    scored = SimpleNamespace(items=items, success=success, prompt_texts=PROMPTS, rollouts=rollouts,
                             rewards=ADVANTAGES.clone(),
                             own_prompt_ids=lambda b: rollouts.prompt_ids[b * G][rollouts.prompt_mask[b * G]].tolist())
    batch = TrainBatch(scored=scored, advantages=ADVANTAGES.clone())
    exchange = ExperienceExchange()
    exchange.publish([SuccessRecord(prompt_id="p1", source="peer", step=step, completion_text=text, reward=1.0,
                                    verifier="rg_exact", verifier_version="test")])
    system = SimpleNamespace(score=lambda texts, items: (None, torch.ones(len(texts)), None))  # group mode's scoring
    probe.on_compose_batch(SimpleNamespace(exchange=exchange, rollout_step=step, workers=workers), system, policy,
                           batch)
    assert len(batch.aux_losses) == 1
    optimizer = _Capture(policy.model.parameters())
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    return optimizer.grads, metrics, batch.aux_losses[0]


@pytest.mark.parametrize("text", [" 2", " 2 is the answer to it"])  # the second is wider than L = 5 tokens
@pytest.mark.parametrize("mode", ["nll", "group"])
def test_a_fused_step_gives_the_measured_steps_gradient(lm_dir, text, mode):
    policy, rollouts = _policy(lm_dir)
    probe = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.3, measure_share_every_n_steps=4,
                                 transfer_mode=mode)
    exact, measured, term = _step(policy, rollouts, probe, 0, text)
    assert term.fused_scale is None and measured["probe/sgt/me/share_measured"] == 1.0
    scale = measured["probe/sgt/me/grad_scale"]
    assert 0.0 < scale < 1.0  # the bound binds, so a wrong factor would show
    fused, metrics, term = _step(policy, rollouts, probe, 1, text)
    assert term.fused_scale == scale and metrics["probe/sgt/me/share_measured"] == 0.0
    assert "probe/sgt/me/grad_share" not in metrics  # no share is claimed for a step that measured none
    assert metrics["train/me/aux_loss_time_s"] > 0.0
    assert torch.allclose(fused, exact, rtol=1e-4, atol=1e-6 * float(exact.abs().max()))
    assert float((fused - exact).norm()) < 1e-4 * float(exact.norm())


def test_measured_on_the_first_step_and_every_kth_after(lm_dir):
    policy, rollouts = _policy(lm_dir)
    probe = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.3, measure_share_every_n_steps=3)
    kinds = [_step(policy, rollouts, probe, step)[2].fused_scale is None for step in (5, 6, 7, 8, 9, 11, 12)]
    assert kinds == [True, False, False, True, False, True, False]  # k steps after the last measured one


def test_every_step_measured_by_default_and_on_several_ranks(lm_dir):
    policy, rollouts = _policy(lm_dir)
    default = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.3)
    assert [_step(policy, rollouts, default, s)[2].fused_scale for s in (0, 1)] == [None, None]
    probe = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.3, measure_share_every_n_steps=10)
    two = SimpleNamespace(group_size=lambda name: 2, group_sum=lambda name, x: x, group_gather=lambda name, x: [x])
    assert [_step(policy, rollouts, probe, s, workers=two)[2].fused_scale for s in (0, 1)] == [None, None]


def test_a_resumed_probe_fuses_as_the_uninterrupted_one(lm_dir):
    policy, rollouts = _policy(lm_dir)
    probe = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.3, measure_share_every_n_steps=5)
    _, measured, _ = _step(policy, rollouts, probe, 0)
    resumed = SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=0.3, measure_share_every_n_steps=5)
    resumed.load_state_dict(probe.state_dict())
    merged = SuccessGatedTransfer(measure_share_every_n_steps=5)
    merged.load_state_dict(merged.merge_rank_states([probe.state_dict()]))
    for p in (probe, resumed, merged):
        assert _step(policy, rollouts, p, 2)[2].fused_scale == measured["probe/sgt/me/grad_scale"]


@pytest.mark.parametrize("k", [0, -3, True, 2.5])
def test_measure_share_every_n_steps_must_be_a_positive_integer(k):
    with pytest.raises(ConfigError, match="measure_share_every_n_steps"):
        SuccessGatedTransfer(measure_share_every_n_steps=k)
