"""PolicyModule with ``chat_template``: prompts in the tokenizer's chat format, one BOS, and
transferred successes (SGT, PRP via THL) behind the receiver's own chat prompt.

Local tokenizers only (trained by the project's recipes on a few lines, saved with a chat
template and loaded back with ``from_pretrained``). Expected texts are written out by hand
from the templates below; expected ids are the tokenizer's own encodings of those texts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks.sgt import SuccessGatedTransfer
from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import SuccessRecord
from mrl_lightning.exchange.buffer import ExperienceExchange
from mrl_lightning.policy import PolicyModule
from mrl_lightning.recipes.tokenizers import train_byte_level_bpe, train_sentencepiece_bpe
from mrl_lightning.thl import retokenize, transfer_trace

CORPUS = ["What is 7 - 5?", "Calculate 12 + 34.", "You are a careful solver.", "Answer: 46 2"] * 20
MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Writes the BOS itself, as Llama 3's and Mistral's templates do.
WITH_BOS = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ITEM = PromptItem("gsm8k/1", "What is 7 - 5?", "2", "gsm8k", {})


def _save(folder, kind: str, template: str | None) -> str:
    train = train_sentencepiece_bpe if kind == "sentencepiece" else train_byte_level_bpe
    tok = train(CORPUS, 300, folder)
    tok.add_tokens(MARKERS, special_tokens=True)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A SentencePiece-style tokenizer that adds ``<s>`` itself and a template that writes it too."""
    return _save(tmp_path_factory.mktemp("chat_bos"), "sentencepiece", WITH_BOS)


def _policy(folder, **kwargs) -> PolicyModule:
    return PolicyModule(name="chat", model=folder, prompt_template="{question}\nAnswer:", **kwargs)


def test_chat_policy_renders_the_template_with_system_and_user_turns(chat_dir):
    policy = _policy(chat_dir, chat_template=True, system_prompt="You are a careful solver.")
    assert policy.render_prompt(ITEM) == ("<s><|system|>You are a careful solver.<|end|>"
                                          "<|user|>What is 7 - 5?\nAnswer:<|end|><|assistant|>")


def test_plain_policy_keeps_the_hand_written_template(chat_dir):
    assert _policy(chat_dir).render_prompt(ITEM) == "What is 7 - 5?\nAnswer:"


def test_chat_prompt_ids_start_with_exactly_one_bos(chat_dir):
    policy = _policy(chat_dir, chat_template=True)
    text = policy.render_prompt(ITEM)
    tok = policy.tokenizer
    bos = tok.bos_token_id
    assert tok(text)["input_ids"][:2] == [bos, bos]  # what a plain encode would have given
    (ids,) = policy.encode_prompts([text])
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_thl_prompt_ids_of_a_chat_prompt_equal_the_policys_own(chat_dir):
    # THL encodes the receiver's rendered prompt for a transferred completion; it must give
    # the ids the receiver's own rollouts start with (one BOS), not the doubled-BOS plain encode.
    policy = _policy(chat_dir, chat_template=True)
    text = policy.render_prompt(ITEM)
    (own,) = policy.encode_prompts([text])
    r = retokenize(policy.tokenizer, text, " 2", add_eos=True)
    assert r.prompt_ids == own
    assert r.prompt_ids.count(policy.tokenizer.bos_token_id) == 1


def test_thl_prompt_ids_of_a_plain_prompt_are_unchanged(chat_dir):
    tok = AutoTokenizer.from_pretrained(chat_dir)
    text = "What is 7 - 5?\nAnswer:"
    assert retokenize(tok, text, " 2").prompt_ids == tok(text)["input_ids"]
    assert tok(text)["input_ids"][0] == tok.bos_token_id


def test_prp_trace_of_a_peer_completion_sits_behind_the_receivers_chat_prompt(chat_dir, tmp_path):
    receiver = _policy(chat_dir, chat_template=True)
    source = AutoTokenizer.from_pretrained(_save(tmp_path, "byte_level", None))
    ids = source(" 2", add_special_tokens=False)["input_ids"]
    text = receiver.render_prompt(ITEM)
    trace = transfer_trace(source, ids, [-0.5] * len(ids), receiver.tokenizer, text, " 2")
    assert trace.retokenized.prompt_ids == receiver.encode_prompts([text])[0]
    assert trace.round_trip_ok


def test_sgt_transfer_is_rendered_behind_the_receivers_chat_template(chat_dir):
    receiver = _policy(chat_dir, chat_template=True, system_prompt="You are a careful solver.")
    exchange = ExperienceExchange()
    exchange.publish([SuccessRecord(prompt_id=ITEM.prompt_id, source="peer", step=1, completion_text=" 2",
                                    reward=1.0, verifier="math_verify", verifier_version="test")])
    text = receiver.render_prompt(ITEM)
    scored = SimpleNamespace(items=[ITEM], success=torch.tensor([[False, False]]), prompt_texts=[text],
                             own_prompt_ids=lambda b: receiver.encode_prompts([text])[0])
    batch = TrainBatch(scored=scored, advantages=torch.zeros(1, 2))
    SuccessGatedTransfer().on_compose_batch(SimpleNamespace(exchange=exchange, rollout_step=1), None, receiver, batch)
    assert batch.metrics["probe/sgt/chat/transfers"] == 1.0
    ((prompt_ids, completion_ids),) = batch.aux_losses[0].demos
    tok = receiver.tokenizer
    assert prompt_ids == receiver.encode_prompts([text])[0]
    assert prompt_ids.count(tok.bos_token_id) == 1
    assert tok.decode(prompt_ids).startswith("<s><|system|>")
    # it ends as the receiver's own completions end: with its template's end of turn, not EOS
    assert completion_ids[-1] == receiver.end_of_turn_id == tok.convert_tokens_to_ids("<|end|>") != tok.eos_token_id
    assert tok.decode(completion_ids[:-1]).strip() == "2"


def test_system_prompt_without_chat_template_is_a_config_error(chat_dir):
    with pytest.raises(ConfigError, match="system_prompt='Be brief.' needs chat_template: true"):
        _policy(chat_dir, system_prompt="Be brief.")


def test_chat_template_on_a_tokenizer_without_one_is_a_config_error(tmp_path):
    folder = _save(tmp_path, "sentencepiece", None)
    with pytest.raises(ConfigError, match="chat_template=true but tokenizer .* has no chat template"):
        _policy(folder, chat_template=True)
