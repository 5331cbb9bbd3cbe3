"""SGT ``transfer_mode: group``: transferred successes join the receiver's group (docs/probes.md).

Group advantages over own G + m transfers (Bessel std, eps 1e-4), the transfer loss with the
batch's own normalizers, and the callback's bookkeeping, with values worked out by hand.
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
from mrl_lightning.probes.sgt import sgt_group_loss, transfer_group_advantages


def test_all_fail_group_with_one_transfer():
    # rewards 0 x 8 + 1: mean 1/9, Bessel var (8/81 + 64/81) / 8 = 1/9, std 1/3
    own, (demo,) = transfer_group_advantages(torch.zeros(1, 8), [[1.0]])
    assert own[0].tolist() == pytest.approx([(-1 / 9) / (1 / 3 + 1e-4)] * 8)
    assert demo.tolist() == pytest.approx([(8 / 9) / (1 / 3 + 1e-4)])  # 2.666


def test_group_with_an_own_success_and_two_prompts():
    # row 0: [1, 0, 0, 0] + [1] -> mean 0.4, centered [.6, -.4, -.4, -.4, .6], var 1.2 / 4 = 0.3
    # row 1: [0, 0, 0, 0] + [1, 1] -> mean 1/3, centered [-1/3 x4, 2/3 x2], var (4/9 + 8/9) / 5 = 4/15
    own, demos = transfer_group_advantages(torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]), [[1.0], [1.0, 1.0]])
    s0, s1 = 0.3 ** 0.5 + 1e-4, (4 / 15) ** 0.5 + 1e-4
    assert own[0].tolist() == pytest.approx([0.6 / s0, -0.4 / s0, -0.4 / s0, -0.4 / s0])
    assert demos[0].tolist() == pytest.approx([0.6 / s0])
    assert own[1].tolist() == pytest.approx([-1 / 3 / s1] * 4)
    assert demos[1].tolist() == pytest.approx([2 / 3 / s1] * 2)


def test_scale_none_only_centers():
    own, (demo,) = transfer_group_advantages(torch.zeros(1, 3), [[1.0]], scale_rewards="none")
    assert own[0].tolist() == pytest.approx([-0.25] * 3) and demo.tolist() == pytest.approx([0.75])


def test_mismatched_rows_and_empty_demos_are_refused():
    with pytest.raises(ValueError, match=r"R = len\(demo_rewards\) = 2"):
        transfer_group_advantages(torch.zeros(1, 4), [[1.0], [1.0]])
    with pytest.raises(ValueError, match="at least one transferred success"):
        transfer_group_advantages(torch.zeros(1, 4), [[]])


LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]])
MASK = torch.tensor([[True, True], [True, False]])
ADV = torch.tensor([2.0, -1.0])  # token losses -A * logp: [[2, 4], [-0.5, (masked)]]


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("dapo", 0.5 * (2 + 4 - 0.5) / 10),                   # sum / batch tokens
        ("bnpo", 0.5 * (2 + 4 - 0.5) / 10),
        ("grpo", 0.5 * ((2 + 4) / 2 + (-0.5) / 1) / 4),       # per-sequence means / batch sequences
        ("dr_grpo", 0.5 * (2 + 4 - 0.5) / (4 * 8)),           # sum / (sequences * max_completion_length)
    ],
)
def test_group_loss_uses_the_batch_normalizers(loss_type, expected):
    loss = sgt_group_loss(LOGP, MASK, ADV, 0.5, loss_type, num_sequences=4, num_tokens=10, max_completion_length=8)
    assert float(loss) == pytest.approx(expected)


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from mrl_lightning.recipes.tokenizers import train_char_level

    return train_char_level(["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?"], tmp_path_factory.mktemp("sgt_g"))


def test_callback_in_group_mode_replaces_the_rescued_rows_advantages_and_counts_the_demos(char_tokenizer):
    exchange = ExperienceExchange()
    exchange.publish([SuccessRecord(prompt_id="p0", source="peer", step=3, completion_text=" 46", reward=1.0,
                                    verifier="rg_exact", verifier_version="test")])
    trainer = SimpleNamespace(exchange=exchange, rollout_step=3)
    policy = SimpleNamespace(policy_name="me", tokenizer=char_tokenizer, max_prompt_length=64, scale_rewards="group",
                             end_of_turn_id=char_tokenizer.eos_token_id)
    items = [PromptItem("p0", "q", "46", "add", {}), PromptItem("p1", "q", "2", "sub", {})]
    success = torch.tensor([[False] * 4, [True, False, False, False]])
    rewards = success.float() + 0.2  # combined rewards: the format reward counts too
    texts = ["12 + 34?\nAnswer:", "7 - 5?"]
    scored = SimpleNamespace(items=items, success=success, rewards=rewards, prompt_texts=texts,
                             own_prompt_ids=lambda b: char_tokenizer(texts[b])["input_ids"])
    advantages = torch.tensor([[0.0] * 4, [1.5, -0.5, -0.5, -0.5]])
    batch = TrainBatch(scored=scored, advantages=advantages.clone(), counts={"sequences": 8.0, "tokens": 20.0})
    def score(texts, score_items):  # a verifier (1) plus a format reward (0.2 for any answer)
        assert texts == [" 46"] and [x.prompt_id for x in score_items] == ["p0"]
        return None, torch.tensor([1.2]), torch.tensor([True])

    SuccessGatedTransfer(lambda_sgt=1.0, transfer_mode="group").on_compose_batch(
        trainer, SimpleNamespace(score=score), policy, batch)
    (aux,) = batch.aux_losses
    ((_, completion),) = aux.demos  # " 46" + EOS in a char-level tokenizer: 4 tokens
    assert len(completion) == 4
    # p0: own [0.2] * 4 + the demo's combined 1.2 (not the verifier's 1.0): mean 0.4,
    # Bessel var (4 * 0.04 + 0.64) / 4 = 0.2
    std = 0.2 ** 0.5 + 1e-4
    assert batch.advantages[0].tolist() == pytest.approx([-0.2 / std] * 4)
    assert aux.advantages.tolist() == pytest.approx([0.8 / std])
    assert torch.equal(batch.advantages[1], advantages[1])  # not rescued: untouched
    assert batch.counts["sequences"] == 9.0 and batch.counts["tokens"] == 24.0
    assert aux.name == "sgt" and batch.counts["sgt_demos"] == 1.0


def test_unknown_transfer_mode_lists_the_valid_ones():
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"transfer_mode='pool'; valid: \['nll', 'group'\]"):
        SuccessGatedTransfer(transfer_mode="pool")
