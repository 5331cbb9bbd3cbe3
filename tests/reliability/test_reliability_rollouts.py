"""Hostile model outputs and prompts (docs/reliability.md, "Model outputs and prompts")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from reliability_helpers import force_logits

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks import SharedExperienceExchange
from mrl_lightning.data.items import PromptItem
from mrl_lightning.model.numerics import MAX_CONSECUTIVE_SKIPS, NonFiniteError
from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.update.policy_update import loss_counts, policy_update
from mrl_lightning.loop.reporting import rollout_metrics
from mrl_lightning.rewards import RewardFunction
from mrl_lightning.thl import retokenize

ITEMS = [PromptItem("add/0", "Calculate 12 + 34.", "46", "add", {}),
         PromptItem("add/1", "What is 7 - 5?", "2", "add", {})]
FABRIC = SimpleNamespace(
    backward=lambda loss: loss.backward(),
    clip_gradients=lambda module, optimizer, max_norm: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm),
)


class Alternating(RewardFunction):
    """1.0 for every other completion: every group has reward variance, so every row has an advantage."""

    name, version, strict = "alternating", "1", True

    def __init__(self):
        self.seen = []

    def __call__(self, completions, items):
        self.seen.extend(completions)
        return [float(i % 2) for i in range(len(completions))]


def _system(policy, reward=None):
    from mrl_lightning.loop.system import MutualRL

    return MutualRL(policies=[policy], reward_funcs=[reward or Alternating()])


def _eos_only(policy):
    eos = policy.tokenizer.eos_token_id

    def fill(logits):
        out = torch.full_like(logits, -30.0)
        out[..., eos] = 30.0
        return out

    return fill


def _update(policy, scored):
    batch = TrainBatch(scored, group_advantages(scored.rewards), counts=loss_counts(policy, scored.rollouts))
    optimizer = policy.configure_optimizers()
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    changed = any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))
    return metrics, changed


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_logits_at_sampling_name_the_policy_and_the_fix(make_policy, value):
    policy = make_policy()
    system = _system(policy)
    with force_logits(policy.model, lambda logits: torch.full_like(logits, value)):
        with pytest.raises(NonFiniteError) as info:
            system.rollout(policy, ITEMS, seed=0)
    msg = str(info.value)
    assert "policy 'tiny'" in msg and "NaN or inf logits" in msg and "learning_rate" in msg and "--ckpt_path" in msg


def test_non_finite_logits_that_sampling_lets_through_are_caught_by_their_logprobs(make_policy):
    policy = make_policy()

    def half_nan(logits):  # the sampled token's own logit is fine, the normalizer is not
        out = logits.clone()
        out[..., -1] = float("nan")
        return out

    system = _system(policy)
    system.engine.generate = lambda *a, **k: _greedy(policy, half_nan)
    with pytest.raises(NonFiniteError, match="non-finite log-prob"):
        system.rollout(policy, ITEMS, seed=0)


def _greedy(policy, fill):
    from mrl_lightning.rollout import HFGenerateEngine

    with force_logits(policy.model, fill):
        return HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(
            [policy.render_prompt(x) for x in ITEMS]), num_generations=policy.num_generations,
            max_completion_length=policy.max_completion_length, do_sample=False)


def test_nan_loss_at_an_update_is_skipped_counted_and_weights_stay_finite(make_policy):
    policy = make_policy()
    scored = _system(policy).rollout(policy, ITEMS, seed=0)
    nan_in_training = force_logits(policy.model, lambda logits: logits * float("nan"), when=lambda head: head.training)
    with nan_in_training, pytest.warns(UserWarning, match="policy 'tiny': gradient norm nan.*skipped"):
        metrics, changed = _update(policy, scored)
    assert metrics["train/tiny/nonfinite_updates_skipped"] == 1.0 and not changed
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())
    metrics, changed = _update(policy, scored)  # the next finite update steps again
    assert metrics["train/tiny/nonfinite_updates_skipped"] == 0.0 and changed


def test_a_policy_that_never_gets_a_finite_update_stops_the_run(make_policy):
    policy = make_policy()
    scored = _system(policy).rollout(policy, ITEMS, seed=0)
    with force_logits(policy.model, lambda logits: logits * float("nan"), when=lambda head: head.training):
        with pytest.warns(UserWarning):
            for _ in range(MAX_CONSECUTIVE_SKIPS - 1):
                _update(policy, scored)
        with pytest.raises(NonFiniteError, match=f"{MAX_CONSECUTIVE_SKIPS} updates in a row"):
            _update(policy, scored)


def test_completion_of_only_eos_counts_one_token_and_trains(make_policy):
    policy = make_policy()
    reward = Alternating()
    with force_logits(policy.model, _eos_only(policy)):
        scored = _system(policy, reward).rollout(policy, ITEMS, seed=0)
    r = scored.rollouts
    assert r.completion_mask.sum(1).tolist() == [1] * 8 and r.finish_reasons == ["stop"] * 8
    assert r.completion_texts == [""] * 8 and reward.seen == [""] * 8  # the verifier gets the empty text
    metrics, changed = _update(policy, scored)
    assert torch.isfinite(torch.tensor(metrics["train/tiny/loss"])) and changed


def test_empty_completions_publish_records_and_can_be_transferred(make_policy):
    policy = make_policy()
    with force_logits(policy.model, _eos_only(policy)):
        scored = _system(policy).rollout(policy, ITEMS, seed=0)
    see = SharedExperienceExchange()
    records = see.records_for(scored, step=1, policy=policy, verifier=SimpleNamespace(name="alternating", version="1"))
    rollouts = [r for r in records if r.record_type == "rollout"]
    assert len(rollouts) == 8 and all(r.completion_text == "" and len(r.token_ids) == 1 for r in rollouts)
    successes = [r for r in records if r.record_type == "success"]
    assert len(successes) == 4  # two per prompt, the same empty text: held once each
    assert see.exchange.publish(records) == 2 + 8 + 2
    # an empty verified success retokenizes to the receiver's EOS alone (SGT's demo)
    demo = retokenize(policy.tokenizer, "What is 7 - 5?\nAnswer:", "", add_eos=True)
    assert demo.completion_ids == [policy.tokenizer.eos_token_id] and demo.round_trip_ok


def test_every_completion_truncated_gives_a_finite_loss_and_no_step_when_masked(make_policy):
    policy = make_policy(mask_truncated_completions=True, weight_decay=0.0)
    never_eos = lambda logits: logits.index_fill(-1, torch.tensor([policy.tokenizer.eos_token_id]), -1e4)  # noqa: E731
    with force_logits(policy.model, never_eos):
        scored = _system(policy).rollout(policy, ITEMS, seed=0)
    assert rollout_metrics(scored, policy)["rollout/tiny/truncated_share"] == 1.0
    assert loss_counts(policy, scored.rollouts)["tokens"] == 0.0
    metrics, changed = _update(policy, scored)
    assert metrics["train/tiny/loss"] == 0.0 and metrics["train/tiny/grad_norm"] == 0.0 and not changed
    assert metrics["train/tiny/nonfinite_updates_skipped"] == 0.0


def test_prompt_longer_than_max_prompt_length_is_cut_counted_and_warned_once(make_policy):
    policy = make_policy(max_prompt_length=16)
    short_item = PromptItem("add/8", "7-5?", "2", "add", {})
    long_item = PromptItem("add/9", "Calculate 12 + 34 + 12 + 34 + 12 + 34.", "138", "add", {})
    full = len(policy.tokenizer(policy.render_prompt(long_item))["input_ids"])
    assert full > 16
    with pytest.warns(UserWarning, match=f"prompt of {full} tokens is longer than max_prompt_length=16") as caught:
        ids = policy.encode_prompts([policy.render_prompt(long_item), policy.render_prompt(short_item)])
        policy.encode_prompts([policy.render_prompt(long_item)])
    assert len([w for w in caught if "max_prompt_length" in str(w.message)]) == 1
    assert len(ids[0]) == 16 and policy.tokenizer.decode(ids[0]).endswith("\nAnswer:") and len(ids[1]) < 16
    assert policy.prompts_truncated == 2 and policy.last_prompts_truncated_share == 1.0
    scored = _system(policy).rollout(policy, [long_item, short_item], seed=0)
    assert rollout_metrics(scored, policy)["rollout/tiny/prompts_truncated_share"] == 0.5
