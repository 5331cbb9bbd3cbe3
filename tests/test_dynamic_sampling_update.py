"""A dynamic-sampling step that keeps no group takes no optimizer step (docs/grpo.md, "Dynamic sampling").

The update (:func:`~mrl_lightning.update.policy_update.policy_update`) of a tiny GPT-2 runs on a batch whose
groups dynamic sampling all dropped (``keep`` all False): nothing is trained on, so AdamW is not
stepped (its momentum and weight decay would move the weights, and the step would count towards
the warm-up); the weights and the optimizer's state stay bit for bit, and the skip is logged under
``train/<p>/empty_updates_skipped``. A probe term that carries a gradient still steps.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import AuxiliaryLoss, TrainBatch
from mrl_lightning.data.items import PromptItem
from mrl_lightning.rewards import RewardFunction
from mrl_lightning.update.policy_update import new_train_batch, policy_update

ITEMS = [PromptItem("add/0", "Calculate 12 + 34.", "46", "add", {}),
         PromptItem("add/1", "What is 7 - 5?", "2", "add", {})]
FABRIC = SimpleNamespace(
    backward=lambda loss: loss.backward(),
    clip_gradients=lambda module, optimizer, max_norm: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm),
)


class Alternating(RewardFunction):
    """1.0 for every other completion: every group has a signal."""

    name, version, strict = "alternating", "1", True

    def __call__(self, completions, items):
        return [float(i % 2) for i in range(len(completions))]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    folder = tmp_path_factory.mktemp("dynamic_sampling_update")
    tok = train_char_level(["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"], folder)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    return folder


def _policy(folder):
    from mrl_lightning.builders import build_policy
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.loop.system import MutualRL

    policy = PolicyModule(name="tiny", model=str(folder), num_generations=4, max_completion_length=6,
                          prompt_template="{question}\nAnswer:", learning_rate=1e-2, weight_decay=0.1,
                          warmup_steps=10, num_iterations=2, filter_groups=True, max_num_gen_batches=1)
    build_policy(policy)
    scored = MutualRL(policies=[policy], reward_funcs=[Alternating()]).rollout(policy, ITEMS, seed=0)
    return policy, scored


def _batch(policy, scored, keep: list[bool]) -> TrainBatch:
    """The batch as the loop hands it to the update: the kept groups only, one rank's counts as the group's."""
    batch = new_train_batch(policy, scored, keep=torch.tensor(keep)).for_update()
    batch.group_counts = dict(batch.counts)
    return batch


def _state(policy, optimizer):
    return [p.detach().clone() for p in policy.model.parameters()], copy.deepcopy(optimizer.state_dict())


def _assert_same_state(before, after):
    (weights, opt), (weights2, opt2) = before, after
    assert all(torch.equal(a, b) for a, b in zip(weights, weights2))
    assert opt["param_groups"] == opt2["param_groups"]  # the lr the warm-up set, untouched
    assert opt["state"].keys() == opt2["state"].keys()
    for key, slot in opt["state"].items():
        assert all(torch.equal(slot[name], opt2["state"][key][name]) for name in slot)  # step, exp_avg, exp_avg_sq


def test_a_step_that_kept_no_group_leaves_weights_and_optimizer_state_bit_for_bit(tiny_folder):
    policy, scored = _policy(tiny_folder)
    optimizer = policy.configure_optimizers()
    first = policy_update(policy, _batch(policy, scored, [True, True]), policy.model, FABRIC, optimizer)
    assert first.get("train/tiny/empty_updates_skipped", 0.0) == 0.0  # a full batch steps (fills AdamW's moments)
    assert policy.optimizer_steps_taken == 2
    assert any(float(slot["exp_avg"].abs().max()) > 0 for slot in optimizer.state.values())
    before = _state(policy, optimizer)

    metrics = policy_update(policy, _batch(policy, scored, [False, False]), policy.model, FABRIC, optimizer)
    _assert_same_state(before, _state(policy, optimizer))
    assert metrics["train/tiny/empty_updates_skipped"] == 2.0  # both iterations (num_iterations: 2)
    assert metrics["train/tiny/nonfinite_updates_skipped"] == 0.0 and metrics["train/tiny/grad_norm"] == 0.0
    assert policy.optimizer_steps_taken == 2  # an engine with its own weights (vLLM) has nothing to reload
    assert all(p.grad is None for p in policy.model.parameters())


class _Pull(AuxiliaryLoss):
    """A probe term with a gradient of its own (no bound): the log-prob of the first own completion."""

    name = "pull"

    def __init__(self, scored):
        self.r = scored.rollouts

    def __call__(self, policy, model, totals):
        r = self.r
        logp, _ = policy.completion_logprobs(r.prompt_ids[:1], r.prompt_mask[:1], r.completion_ids[:1],
                                             r.completion_mask[:1], model=model)
        return -(logp * r.completion_mask[:1]).sum(), {}


def test_a_probe_term_with_a_gradient_still_steps_when_no_group_was_kept(tiny_folder):
    policy, scored = _policy(tiny_folder)
    optimizer = policy.configure_optimizers()
    batch = _batch(policy, scored, [False, False])
    batch.aux_losses.append(_Pull(scored))
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))
    assert metrics["train/tiny/empty_updates_skipped"] == 0.0 and policy.optimizer_steps_taken == 2
