"""SGT's transfer term never takes more of the update than ``max_grad_share`` (docs/probes.md).

A hand-made batch on a tiny GPT-2: two prompts with three own completions each and fixed
advantages, one all-fail prompt that a peer solved, and a transfer weight so large that the
unbounded transfer gradient dwarfs the GRPO gradient. The gradients reaching the optimizer
are captured and split by hand into g_grpo (the same batch without the transfer) and the
rest, and the share ||g_sgt|| / (||g_grpo|| + ||g_sgt||) is checked against the bound.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.builders import build_policy
from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.data.items import PromptItem
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.exchange.buffer import ExperienceExchange
from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import policy_update
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.\nAnswer:", "Calculate 7 - 5.\nAnswer:"]
G, L = 3, 5
ADVANTAGES = torch.tensor([[1.0, -0.5, -0.5], [0.0, 0.0, 0.0]])  # prompt 2: all fail, no GRPO signal
FABRIC = SimpleNamespace(backward=lambda loss: loss.backward(), clip_gradients=None)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    folder = tmp_path_factory.mktemp("sgt_share_gpt2")
    tok = train_char_level(["Calculate 12 + 34.\nAnswer: 46", "Calculate 7 - 5.\nAnswer: 2"], folder)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    return folder


class _Capture:
    """An optimizer that records the gradient it is given and leaves the weights alone."""

    def __init__(self, params):
        self.params, self.grads = list(params), None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                for p in self.params])


def _policy(lm_dir):
    """The tiny policy (seeded weights) and its rollouts of ``PROMPTS`` (seeded sampling)."""
    torch.manual_seed(1)
    policy = PolicyModule(name="me", model=str(lm_dir), num_generations=G, max_completion_length=L,
                          max_grad_norm=None)
    build_policy(policy)
    torch.manual_seed(2)
    rollouts = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                           num_generations=G, max_completion_length=L)
    return policy, rollouts


def _update(lm_dir, probe: SuccessGatedTransfer | None):
    policy, rollouts = _policy(lm_dir)
    items = [PromptItem("p0", "1 + 2", "3", "add", {}), PromptItem("p1", "7 - 5", "2", "sub", {})]
    success = torch.tensor([[True, False, False], [False, False, False]])
    scored = SimpleNamespace(items=items, success=success, prompt_texts=PROMPTS, rollouts=rollouts,
                             own_prompt_ids=lambda b: rollouts.prompt_ids[b * G][rollouts.prompt_mask[b * G]].tolist())
    batch = TrainBatch(scored=scored, advantages=ADVANTAGES.clone())
    if probe is not None:
        exchange = ExperienceExchange()
        exchange.publish([SuccessRecord(prompt_id="p1", source="peer", step=0, completion_text=" 2", reward=1.0,
                                        verifier="rg_exact", verifier_version="test")])
        probe.on_compose_batch(SimpleNamespace(exchange=exchange, rollout_step=0), None, policy, batch)
        assert len(batch.aux_losses) == 1 and batch.metrics["probe/sgt/me/transfers"] == 1.0
    optimizer = _Capture(policy.model.parameters())
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    return optimizer.grads, metrics


@pytest.mark.parametrize("bound", [0.2, 0.5])
def test_transfer_share_of_the_update_stays_within_the_bound(lm_dir, bound):
    g_grpo, _ = _update(lm_dir, None)
    g_free, free = _update(lm_dir, SuccessGatedTransfer(lambda_sgt=50.0))
    g_bound, bounded = _update(lm_dir, SuccessGatedTransfer(lambda_sgt=50.0, max_grad_share=bound))
    n_grpo = float(g_grpo.norm())
    assert n_grpo > 0
    raw = float((g_free - g_grpo).norm()) / (n_grpo + float((g_free - g_grpo).norm()))
    assert raw > 0.9  # lambda 50: unbounded, the transfer is almost the whole update
    assert free["probe/sgt/me/grad_share"] == pytest.approx(raw, abs=1e-4)

    g_sgt = g_bound - g_grpo
    share = float(g_sgt.norm()) / (n_grpo + float(g_sgt.norm()))
    assert share <= bound + 1e-4
    assert share == pytest.approx(bound, abs=1e-4)  # scaled down to the bound, not below it
    assert bounded["probe/sgt/me/grad_share"] == pytest.approx(share, abs=1e-4)
    assert bounded["probe/sgt/me/grad_share_raw"] == pytest.approx(raw, abs=1e-4)
    # only the size changes: the bounded transfer points where the free one does
    cosine = torch.nn.functional.cosine_similarity(g_sgt, g_free - g_grpo, dim=0)
    assert float(cosine) == pytest.approx(1.0, abs=1e-4)


def test_a_transfer_within_the_bound_is_left_alone(lm_dir):
    g_free, free = _update(lm_dir, SuccessGatedTransfer(lambda_sgt=1e-4))
    g_bound, bounded = _update(lm_dir, SuccessGatedTransfer(lambda_sgt=1e-4, max_grad_share=0.5))
    assert free["probe/sgt/me/grad_share"] < 0.5
    assert bounded["probe/sgt/me/grad_scale"] == 1.0
    assert torch.equal(g_free, g_bound)


@pytest.mark.parametrize("bound", [0.0, 1.0, 2.0])
def test_bound_outside_zero_one_is_a_config_error(bound):
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=f"max_grad_share={bound} must be in \\(0, 1\\)"):
        SuccessGatedTransfer(max_grad_share=bound)
