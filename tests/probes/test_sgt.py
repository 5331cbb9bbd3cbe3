"""SGT, Success-Gated Transfer (docs/probes.md): the rescue set, the transfer loss by hand, the callback gate.

Rescue set of receiver i: prompts where i's own group success rate <= kappa (default 0)
AND a peer holds a verified success for that prompt; up to m distinct texts each.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.data.items import PromptItem
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.exchange.buffer import ExperienceExchange
from mrl_lightning.probes.sgt import pad_demos, rescue_set, sgt_loss

T, F = True, False
OWN = torch.tensor([
    [F, F, F, F],  # p0: all fail, peers succeeded         -> rescued
    [T, F, F, F],  # p1: one own success (rate 0.25)       -> not with kappa 0
    [F, F, F, F],  # p2: all fail, but no peer success     -> not rescued
    [F, F, F, F],  # p0 again in the same step             -> rescued once (row 0)
    [F, F, F, F],  # p3: all fail, peer list empty         -> not rescued
])
PIDS = ["p0", "p1", "p2", "p0", "p3"]
PEER = {"p0": ["x", "x", "y", "z"], "p1": ["w"], "p3": [], "p9": ["never asked"]}


def test_rescues_only_all_fail_prompts_that_a_peer_solved():
    assert rescue_set(OWN, PIDS, PEER, kappa=0.0, max_per_prompt=2) == {0: ["x", "y"]}


def test_transfers_are_deduplicated_by_text_and_capped_at_m():
    # Distinct texts of p0 in preference order: x, y, z.
    assert rescue_set(OWN, PIDS, PEER, max_per_prompt=1) == {0: ["x"]}
    assert rescue_set(OWN, PIDS, PEER, max_per_prompt=5) == {0: ["x", "y", "z"]}


def test_kappa_admits_prompts_with_a_low_own_success_rate():
    # p1's own rate is 1/4 = 0.25: in with kappa = 0.25, out with kappa = 0.2.
    assert rescue_set(OWN, PIDS, PEER, kappa=0.25, max_per_prompt=2) == {0: ["x", "y"], 1: ["w"]}
    assert rescue_set(OWN, PIDS, PEER, kappa=0.2, max_per_prompt=2) == {0: ["x", "y"]}
    # kappa = 0.5 still needs a peer success: p2 (no peer) stays out.
    assert 2 not in rescue_set(OWN, PIDS, PEER, kappa=0.5)


def test_no_peer_successes_means_no_transfer():
    assert rescue_set(OWN, PIDS, {}, kappa=1.0) == {}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(own_success=torch.zeros(4, 4, dtype=torch.bool)), r"\[B, G\] with B = len\(prompt_ids\) = 5"),
        (dict(kappa=1.5), "kappa=1.5"),
        (dict(max_per_prompt=0), "max_per_prompt=0"),
    ],
)
def test_rescue_set_rejects_bad_arguments(kwargs, message):
    args = dict(own_success=OWN, prompt_ids=PIDS, peer_successes=PEER)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rescue_set(**args)


def test_sgt_loss_by_hand():
    # Demo 0: log p = ln 0.5, ln 0.25 (third token masked) -> NLL mean = (ln 2 + 2 ln 2) / 2 = 1.5 ln 2
    # Demo 1: log p = ln 0.5 (rest masked)                  -> NLL mean = ln 2
    # mean over demos = 1.25 ln 2 = 0.8664340;  lambda 0.1 * A_plus 2 -> 0.25 ln 2 = 0.1732868
    logp = torch.tensor([[math.log(0.5), math.log(0.25), -7.0], [math.log(0.5), -9.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[T, T, F], [T, F, F]])
    loss = sgt_loss(logp, mask, lambda_sgt=0.1, advantage_plus=2.0)
    assert float(loss.detach()) == pytest.approx(0.25 * math.log(2), abs=1e-7)
    loss.backward()
    # d/d logp = -lambda A_plus / (M * len_demo): demo 0: -0.2 / (2 * 2) = -0.05; demo 1: -0.2 / (2 * 1) = -0.1
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.05, -0.05, 0.0], [-0.1, 0.0, 0.0]]), rtol=0, atol=1e-7)


def test_sgt_loss_is_zero_without_demos():
    logp = torch.zeros(0, 3, requires_grad=True)
    loss = sgt_loss(logp, torch.zeros(0, 3, dtype=torch.bool), lambda_sgt=0.1)
    assert float(loss.detach()) == 0.0
    loss.backward()  # still differentiable, so the loop can always call backward


def test_pad_demos_left_pads_prompts_and_right_pads_completions():
    p_ids, p_mask, c_ids, c_mask = pad_demos([([1, 2, 3], [4, 5]), ([6], [7, 8, 9])], pad_id=0)
    assert p_ids.tolist() == [[1, 2, 3], [0, 0, 6]]
    assert p_mask.tolist() == [[T, T, T], [F, F, T]]
    assert c_ids.tolist() == [[4, 5, 0], [7, 8, 9]]
    assert c_mask.tolist() == [[T, T, F], [T, T, T]]


# ---------------------------------------------------------------- the callback's gate
@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from mrl_lightning.recipes.tokenizers import train_char_level

    return train_char_level(["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?"], tmp_path_factory.mktemp("sgt_tok"))


def _success(pid, source, step, text):
    return SuccessRecord(prompt_id=pid, source=source, step=step, completion_text=text, reward=1.0,
                         verifier="rg_exact", verifier_version="test")


def test_callback_transfers_only_verified_peer_successes_for_all_fail_prompts(char_tokenizer):
    exchange = ExperienceExchange()
    exchange.publish([
        _success("p0", "peer", 3, " 46"),  # p0: receiver all-fail -> transferred
        _success("p1", "peer", 3, " 12"),  # p1: receiver has a success -> not transferred
        _success("p2", "me", 2, " 2"),     # p2: only the receiver's own old success -> not a peer's
    ])
    trainer = SimpleNamespace(exchange=exchange, rollout_step=3)
    policy = SimpleNamespace(policy_name="me", tokenizer=char_tokenizer, max_prompt_length=64,
                             end_of_turn_id=char_tokenizer.eos_token_id)
    items = [PromptItem(pid, "q", "a", "add", {}) for pid in ("p0", "p1", "p2")]
    own = torch.tensor([[F, F], [T, F], [F, F]])
    texts = ["12 + 34?\nAnswer:", "1 + 11?", "7 - 5?"]
    scored = SimpleNamespace(items=items, success=own, prompt_texts=texts,
                             own_prompt_ids=lambda b: char_tokenizer(texts[b])["input_ids"])
    advantages = torch.tensor([[0.0, 0.0], [0.7, -0.7], [0.0, 0.0]])
    batch = TrainBatch(scored=scored, advantages=advantages.clone())
    SuccessGatedTransfer(lambda_sgt=0.1).on_compose_batch(trainer, None, policy, batch)
    assert batch.metrics["probe/sgt/me/rescue_set_size"] == 1.0
    assert batch.metrics["probe/sgt/me/transfers"] == 1.0
    (aux,) = batch.aux_losses
    ((prompt_ids, completion_ids),) = aux.demos
    # The demo is the peer's text in the receiver's tokens behind the receiver's own prompt, EOS last.
    assert char_tokenizer.decode(prompt_ids) == "12 + 34?\nAnswer:"
    assert completion_ids[-1] == char_tokenizer.eos_token_id
    assert char_tokenizer.decode(completion_ids[:-1]) == " 46"
    # SGT adds a loss term; it does not touch the GRPO advantages.
    assert torch.equal(batch.advantages, advantages)
