"""Stops (docs/rollout.md, "Stops"): a chat model's completion ends at its end-of-turn token on every engine.

The fixture is a tiny GPT-2 chat model whose turn ends with ``<|end|>`` (its
``generation_config.json`` lists ``[eos, <|end|>]``), biased to sample ``<|end|>`` often.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.builders import build_policy
from mrl_lightning.builders.engines import build_vllm_engine
from mrl_lightning.policy import PolicyModule
from mrl_lightning.rollout.hf_generate import HFGenerateEngine
from mrl_lightning.rollout.vllm_engine import ServerVLLM, VLLMEngine

G, L = 6, 10
QUESTIONS = ["12 + 34?", "7 - 5?"]


@pytest.fixture(scope="module")
def chat_policy(tiny_chat_dir):
    policy = PolicyModule(name="chat", model=str(tiny_chat_dir), chat_template=True, num_generations=G,
                          max_completion_length=L, temperature=1.0, rollout_engine="hf")
    build_policy(policy)
    return policy


def _prompts(policy):
    return policy.encode_prompts([policy.render_prompt(SimpleNamespace(question=q)) for q in QUESTIONS])


def _assert_stopped_at_end_of_turn(out, end: int, eos: int) -> None:
    stopped = [i for i, r in enumerate(out.finish_reasons) if r == "stop"]
    assert stopped, "the fixture should end some completions at <|end|> within L tokens"
    for row in range(out.completion_ids.shape[0]):
        ids = out.completion_ids[row][out.completion_mask[row]].tolist()
        if out.finish_reasons[row] == "stop":
            assert ids[-1] in (end, eos) and end not in ids[:-1] and eos not in ids[:-1], ids
            assert out.old_logprobs[row][len(ids):].abs().sum() == 0  # nothing counted after the stop
        else:
            assert out.finish_reasons[row] == "length" and len(ids) == out.completion_ids.shape[1]
            assert end not in ids and eos not in ids
    assert any(out.completion_ids[r][out.completion_mask[r]].tolist()[-1] == end for r in stopped)


def test_the_policy_stops_on_eos_its_generation_config_list_and_its_end_of_turn(chat_policy):
    tok = chat_policy.tokenizer
    end = tok.convert_tokens_to_ids("<|end|>")
    assert chat_policy.end_of_turn_id == end
    assert chat_policy.stop_token_ids == [tok.eos_token_id, end]


def test_hf_engine_stops_at_the_end_of_turn_with_finish_stop(chat_policy):
    tok, end = chat_policy.tokenizer, chat_policy.end_of_turn_id
    engine = HFGenerateEngine()
    out = engine.generate(chat_policy.model, tok, _prompts(chat_policy), num_generations=G, max_completion_length=L,
                          prompt_seeds=[3, 4], stop_token_ids=chat_policy.stop_token_ids)
    _assert_stopped_at_end_of_turn(out, end, tok.eos_token_id)
    # What the engine did before stops were the policy's: EOS only, so <|end|> ran on into a made-up turn.
    eos_only = engine.generate(chat_policy.model, tok, _prompts(chat_policy), num_generations=G,
                               max_completion_length=L, prompt_seeds=[3, 4])
    ran_on = [eos_only.completion_ids[r][eos_only.completion_mask[r]].tolist() for r in range(2 * G)]
    assert any(end in ids[:-1] for ids in ran_on)


def test_vllm_colocated_stops_at_the_end_of_turn(chat_policy):
    from vllm_double import FakeLLM, FakeSamplingParams

    built = []

    def factory(policy, **kwargs):
        llm = FakeLLM(**kwargs)
        built.append(llm)
        return llm, FakeSamplingParams

    policy = PolicyModule(name="chatv", model=chat_policy.model_source, chat_template=True, num_generations=G,
                          max_completion_length=L, temperature=1.0, vllm_gpu_memory_utilization=0.5)
    build_policy(policy)
    engine = build_vllm_engine(policy, [policy], len(QUESTIONS), factory=factory, device_memory_gib=80.0)
    out = engine.generate(policy.model, policy.tokenizer, _prompts(policy), num_generations=G, max_completion_length=L,
                          prompt_seeds=[3, 4], stop_token_ids=policy.stop_token_ids)
    _assert_stopped_at_end_of_turn(out, policy.end_of_turn_id, policy.tokenizer.eos_token_id)


def test_vllm_server_labels_a_completion_ended_at_the_end_of_turn_stop(chat_policy):
    from vllm_double import FakeLLM, FakeVLLMClient

    client = FakeVLLMClient(FakeLLM(str(chat_policy.model_source)))
    engine = VLLMEngine(ServerVLLM(client))
    out = engine.generate(chat_policy.model, chat_policy.tokenizer, _prompts(chat_policy), num_generations=G,
                          max_completion_length=L, prompt_seeds=[3, 4], stop_token_ids=chat_policy.stop_token_ids)
    _assert_stopped_at_end_of_turn(out, chat_policy.end_of_turn_id, chat_policy.tokenizer.eos_token_id)


def test_a_transferred_success_ends_with_the_receivers_end_of_turn_behind_its_own_truncated_prompt(chat_policy):
    """SGT's demo: the receiver's own prompt ids (its rollouts': BOS and template head kept when the
    question is cut) and the completion ending with the receiver's end of turn, not its EOS."""
    from mrl_lightning.update.batch import ScoredRollouts, TrainBatch
    from mrl_lightning.callbacks import SuccessGatedTransfer
    from mrl_lightning.data.items import PromptItem
    from mrl_lightning.exchange import ExperienceExchange, SuccessRecord

    receiver = PolicyModule(name="chat", model=chat_policy.model_source, chat_template=True, num_generations=2,
                            max_completion_length=L, max_prompt_length=12)
    build_policy(receiver)
    item = PromptItem("p0", "Calculate 12 + 34 and write only the number.", "46", "add", {})
    prompt = receiver.render_prompt(item)
    with pytest.warns(UserWarning, match="longer than max_prompt_length"):
        rollouts = HFGenerateEngine().generate(receiver.model, receiver.tokenizer, receiver.encode_prompts([prompt]),
                                               num_generations=2, max_completion_length=L, prompt_seeds=[1],
                                               stop_token_ids=receiver.stop_token_ids)
    own = rollouts.prompt_ids[0][rollouts.prompt_mask[0]].tolist()
    assert len(own) == 12 and own[0] == receiver.tokenizer.bos_token_id  # cut, BOS kept
    scored = ScoredRollouts("chat", [item], rollouts, torch.zeros(2, 1), torch.zeros(1, 2),
                            torch.zeros(1, 2, dtype=torch.bool), [prompt], torch.zeros(2))
    exchange = ExperienceExchange()
    exchange.publish([SuccessRecord("p0", "peer", 0, " 46", 1.0, "exact", "1")])
    batch = TrainBatch(scored, torch.zeros(1, 2))
    SuccessGatedTransfer(lambda_sgt=0.1).on_compose_batch(SimpleNamespace(exchange=exchange, rollout_step=0), None,
                                                          receiver, batch)
    ((prompt_ids, completion_ids),) = batch.aux_losses[0].demos
    assert prompt_ids == own
    assert completion_ids[-1] == receiver.end_of_turn_id != receiver.tokenizer.eos_token_id
    assert receiver.tokenizer.decode(completion_ids[:-1]) == " 46"
