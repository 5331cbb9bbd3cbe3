"""The importance ratio is 1 before the first update at temperature != 1 (docs/grpo.md, "Sampling").

The engine's old log-probs (from the logits ``generate`` produced, KV cache on) and the
training forward pass (``PolicyModule.completion_logprobs``: one full forward with the
prompt left-padded) must agree on every counted token, including the EOS, for prompts
of different lengths, because both use logits / temperature.
"""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.builders import build_policy
from mrl_lightning.objectives.grpo import grpo_loss
from mrl_lightning.policy import PolicyModule
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "ab"]
G, L = 3, 6


def _policy(folder, temperature):
    policy = PolicyModule(name="p", model=str(folder), temperature=temperature, num_generations=G,
                          max_completion_length=L)
    build_policy(policy)
    return policy


def _rollout(policy, seed=1):
    ids = policy.encode_prompts(PROMPTS)
    torch.manual_seed(seed)
    return HFGenerateEngine().generate(policy.model, policy.tokenizer, ids, num_generations=G,
                                       max_completion_length=L, temperature=policy.temperature)


def _reference_logprobs(model, out, temperature):
    """Log-probs of the completion by an independent full forward: log_softmax(logits / T)."""
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    attn = torch.cat([out.prompt_mask, out.completion_mask], dim=1).long()
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    p = out.prompt_ids.shape[1]
    logits = logits[:, p - 1: -1]  # the logits that predict each completion token
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(2, out.completion_ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_importance_ratio_is_one_before_the_first_update(tiny_lm_dir, temperature):
    policy = _policy(tiny_lm_dir, temperature)
    assert policy.model.training  # the training forward runs in train mode
    out = _rollout(policy)
    m = out.completion_mask
    # The batch exercises what could break the match: left padding of unequal prompts,
    # completions that end at an EOS (then pad == EOS) and ones that hit the length limit.
    assert len(set(out.prompt_mask.sum(1).tolist())) == 3
    assert set(out.finish_reasons) == {"stop", "length"}
    with torch.no_grad():
        logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids, m)
    ratio = torch.exp(logp - out.old_logprobs)[m]
    assert (ratio - 1).abs().max() < 1e-5
    # Through the loss: no token is clipped and the largest ratio is 1.
    res = grpo_loss(logp, out.old_logprobs, torch.linspace(-1, 1, G * len(PROMPTS)), m, epsilon=1e-4)
    assert not res.clipped_low.any() and not res.clipped_high.any()


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_old_logprobs_are_those_of_the_temperature_scaled_policy(tiny_lm_dir, temperature):
    policy = _policy(tiny_lm_dir, temperature)
    out = _rollout(policy, seed=2)
    m = out.completion_mask
    scaled = _reference_logprobs(policy.model, out, temperature)
    unscaled = _reference_logprobs(policy.model, out, 1.0)
    assert (scaled - out.old_logprobs)[m].abs().max() < 1e-5
    # Without the division by T the log-probs are far off: a missing temperature would show.
    assert (unscaled - out.old_logprobs)[m].abs().max() > 0.1
    # The same holds for the training side: a policy at T = 1 scores these tokens differently.
    with torch.no_grad():
        logp_t1, _ = _policy(tiny_lm_dir, 1.0).completion_logprobs(out.prompt_ids, out.prompt_mask,
                                                                    out.completion_ids, m)
    assert (logp_t1 - out.old_logprobs)[m].abs().max() > 0.1


def test_importance_ratio_is_one_for_a_model_with_dropout_in_its_config(tmp_path, build_tiny_lm):
    folder = build_tiny_lm(tmp_path / "dropout_lm", dropout=0.1)
    policy = _policy(folder, 0.7)
    out = _rollout(policy)
    torch.manual_seed(3)
    with torch.no_grad():
        logp, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids,
                                             out.completion_mask)
    assert (torch.exp(logp - out.old_logprobs)[out.completion_mask] - 1).abs().max() < 1e-5


@pytest.mark.parametrize(("precision", "engine", "under_autocast"), [
    ("bf16-mixed", "hf", True),  # generate decodes in the update's precision
    ("bf16-mixed", "vllm", False),  # vLLM samples in its own dtype
    ("32-true", "hf", False),
])
def test_sampling_runs_under_the_updates_autocast_for_hf_policies_in_mixed_precision(tmp_path, precision, engine,
                                                                                    under_autocast):
    from types import SimpleNamespace

    from mrl_lightning.loop.trainer import MRLTrainer
    from mrl_lightning.update.policy_update import sampling_precision

    trainer = MRLTrainer(max_steps=1, accelerator="cpu", devices=1, precision=precision,
                         default_root_dir=str(tmp_path), enable_progress_bar=False)
    with sampling_precision(trainer.fabric, [SimpleNamespace(rollout_engine=engine)]):
        seen = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    assert seen[0] is under_autocast
    if under_autocast:
        assert seen[1] == torch.bfloat16
