"""Every family ``TinyCausalLM`` builds, through the path a user's model takes.

Each family is built from its config (no warm-start: tiny widths, random weights), saved
with ``save_pretrained`` and loaded back with ``AutoModelForCausalLM`` / ``AutoTokenizer``
``from_pretrained``. Expected parameter counts, rendered prompts and pre-tokenizations are
worked out by hand below.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from mrl_lightning.model.chat import end_of_turn_id, render_chat_prompt
from mrl_lightning.errors import ConfigError
from mrl_lightning.recipes import TinyCausalLM
from mrl_lightning.recipes.families import FAMILIES, chat_corpus_text
from mrl_lightning.recipes.sft import encode_example, texts_through_end
from mrl_lightning.thl import retokenize

BASE = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_parentheses": False,
        "allow_negation": False}
PARTS = [{"name": "add", "dataset": "basic_arithmetic", "config": dict(BASE, operators=["+"])},
         {"name": "sub", "dataset": "basic_arithmetic", "config": dict(BASE, operators=["-"])}]
WIDTH = 16
# Parameters besides the V x 16 (tied) embedding, 1 layer, width 16, 2 heads of 8, MLP 32 (Llama-like):
#   gpt2:    positions 256*16 = 4096; layer: 2 norms 2*32, qkv 16*48+48 = 816, out 16*16+16 = 272,
#            MLP 16*64+64 + 64*16+16 = 2128 -> 3280; final norm 32: 4096 + 3280 + 32 = 7408
#   llama:   q, k, v, o 4*256 = 1024, gate/up 2*512 + down 512 = 1536, 2 norms 32; final norm 16: 2608
#   qwen2:   1 key/value head: q 256+16, k 128+8, v 128+8 (biased), o 256 = 800, MLP 1536, norms 32;
#            final 16: 2384
#   mistral: 1 key/value head, no biases: q 256, k 128, v 128, o 256 = 768, MLP 1536, norms 32;
#            final 16: 2352
#   phi3:    fused qkv 16*48 = 768, o 256, fused gate/up 16*64 = 1024, down 512, norms 32; final 16: 2608
NON_EMBEDDING = {"gpt2": 7408, "llama": 2608, "qwen2": 2384, "mistral": 2352, "phi3": 2608}
# family -> (tokenizer kind, end-of-turn token; None = EOS, the user prompt "Calculate 3 + 4." rendered)
CASES = {
    "gpt2": ("byte_level_bpe", None, "User: Calculate 3 + 4.\nAssistant:"),
    "llama": ("sentencepiece_bpe", "<|eot_id|>", "<s><|start_header_id|>user<|end_header_id|>\n\nCalculate 3 + 4."
              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen2": ("qwen2_bpe", "<|im_end|>", "<|im_start|>user\nCalculate 3 + 4.<|im_end|>\n<|im_start|>assistant\n"),
    "mistral": ("mistral_v3", None, "<s>[INST]Calculate 3 + 4.[/INST]"),
    "phi3": ("char_level", "<|end|>", "<|user|>\nCalculate 3 + 4.<|end|>\n<|assistant|>\n"),
}
TEXTS = ["Calculate 53 - 4.", " -49", "Q: 7 + 8?\nA: 15", "Answer: 12 (twelve)"]


def test_the_cases_cover_every_family():
    assert set(CASES) == set(FAMILIES) and len(FAMILIES) >= 5


@pytest.fixture(scope="module")
def data():
    from mrl_lightning.data import ReasoningGymDataModule

    module = ReasoningGymDataModule(parts=PARTS, batch_size=2, train_size=40, eval_size=4, seed=0)
    module.setup()
    return module


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("families-cache")


def _policy(family: str, cache, chat: bool):
    from mrl_lightning.policy import PolicyModule

    config = {"family": family, "tokenizer_kind": CASES[family][0], "vocab_size": 300, "hidden_size": WIDTH,
              "num_layers": 1, "num_heads": 2, "cache_dir": str(cache)}  # as the YAML's init_args
    return PolicyModule(name=family, model=TinyCausalLM(**config), chat_template=chat,
                        prompt_template="{question}" if chat else "{question}\nAnswer:", max_completion_length=4)


def _built(family, cache, data, chat):
    policy = _policy(family, cache, chat)
    torch.set_num_threads(1)
    folder = policy.model_source.materialize(policy, data, log=lambda line: None)
    policy.tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    return policy, folder, model


@pytest.mark.parametrize("family", FAMILIES)
def test_family_builds_saves_and_loads_back_through_from_pretrained(family, cache, data):
    policy, folder, model = _built(family, cache, data, chat=False)
    tok = policy.tokenizer
    assert model.config.model_type == family
    assert model.config.vocab_size == len(tok)
    if family == "mistral":
        assert len(tok) == 32_768  # the real v3 vocabulary, whole
    assert sum(p.numel() for p in model.parameters()) == len(tok) * WIDTH + NON_EMBEDDING[family]
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert tok.chat_template is None  # a plain-template policy gets no chat format (and no added tokens)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", TEXTS)
def test_family_tokenizer_round_trips_text(family, text, cache, data):
    policy, _, _ = _built(family, cache, data, chat=True)
    tok = policy.tokenizer
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_the_family_format_and_generation_stops_at_its_end_of_turn(family, cache, data):
    policy, folder, model = _built(family, cache, data, chat=True)
    tok = policy.tokenizer
    _, end_token, rendered = CASES[family]
    assert render_chat_prompt(tok, "Calculate 3 + 4.") == rendered
    eot = tok.eos_token_id if end_token is None else tok.convert_tokens_to_ids(end_token)
    assert end_of_turn_id(tok) == eot
    assert tok.added_tokens_decoder[eot].special  # one special token, dropped from decoded text
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    if end_token is None:
        assert stops == tok.eos_token_id
    else:
        assert eot != tok.eos_token_id and stops == [tok.eos_token_id, eot]

    class ForceAt(LogitsProcessor):  # the model writes one token, then the end of turn
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == prompt_len + 1:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, eot] = 0.0
            return scores

    (ids,) = policy.encode_prompts([rendered])
    prompt_len = len(ids)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
                         max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                         logits_processor=LogitsProcessorList([ForceAt()]))
    assert out.shape[1] == prompt_len + 2 and out[0, -1].item() == eot  # stopped by the saved eos list


@pytest.mark.parametrize("family", FAMILIES)
def test_warm_start_examples_end_with_the_end_of_turn_under_a_chat_template(family, cache, data):
    policy, _, _ = _built(family, cache, data, chat=True)
    tok = policy.tokenizer
    prompt = render_chat_prompt(tok, "Calculate 3 + 4.")
    plain = retokenize(tok, prompt, " 7").completion_ids
    _, completion = encode_example(policy, prompt, " 7")
    end_token = CASES[family][1]
    assert completion == plain + [tok.eos_token_id if end_token is None else tok.convert_tokens_to_ids(end_token)]


def test_a_plain_template_example_still_ends_with_eos(cache, data):
    policy, _, _ = _built("qwen2", cache, data, chat=False)
    _, completion = encode_example(policy, "Calculate 3 + 4.\nAnswer:", " 7")
    assert completion[-1] == policy.tokenizer.eos_token_id


def test_completion_text_is_cut_at_the_end_of_turn(monkeypatch):
    from types import SimpleNamespace

    import mrl_lightning.recipes.sft as sft

    chars = "0123456789 "  # ids 10.. decode to these characters; 1 is the end of turn, 2 EOS
    monkeypatch.setattr(sft, "decode_completion", lambda tok, ids, errors="strict": "".join(chars[i - 10] for i in ids))
    batch = SimpleNamespace(completion_ids=torch.tensor([[20, 14, 12, 1, 15, 15], [13, 2, 0, 0, 0, 0]]),
                            completion_mask=torch.tensor([[True] * 6, [True, True] + [False] * 4]))
    assert texts_through_end(SimpleNamespace(eos_token_id=2), batch, end=1) == [" 42", "3"]


def test_qwen2_pre_tokenizer_differs_from_gpt2_style_where_hand_worked(tmp_path):
    from mrl_lightning.recipes.tokenizers import train_byte_level_bpe, train_qwen2_bpe

    text = "Calculate 53 - 4.\nA: f(x)"
    qwen = train_qwen2_bpe([text] * 5, 260, tmp_path / "q").backend_tokenizer.pre_tokenizer
    gpt2 = train_byte_level_bpe([text] * 5, 260, tmp_path / "g").backend_tokenizer.pre_tokenizer
    pieces = lambda pre: [p for p, _ in pre.pre_tokenize_str(text)]  # noqa: E731
    # Qwen2: a punctuation run keeps its line break (".\n"), a word takes one leading mark ("(x")
    assert pieces(qwen) == ["Calculate", "Ġ", "5", "3", "Ġ-", "Ġ", "4", ".Ċ", "A", ":", "Ġf", "(x", ")"]
    assert pieces(gpt2) == ["Calculate", "Ġ", "5", "3", "Ġ-", "Ġ", "4", ".", "Ċ", "A", ":", "Ġf", "(", "x", ")"]


def test_chat_corpus_text_is_the_format_without_its_special_tokens():
    assert chat_corpus_text("qwen2", "Calculate 3 + 4.", " 7") == "user\nCalculate 3 + 4.\nassistant\n 7\n"
    assert chat_corpus_text("gpt2", "Calculate 3 + 4.", " 7", "Be brief.") == \
        "Be brief.\n\nUser: Calculate 3 + 4.\nAssistant: 7\n"
    assert chat_corpus_text("mistral", "Calculate 3 + 4.", " 7", "Be brief.") == \
        "[INST]Be brief.\n\nCalculate 3 + 4.[/INST] 7"


def test_real_tokenizer_sizes_bound_the_plan():
    assert TinyCausalLM(family="mistral", tokenizer_kind="mistral_v3").model_config().vocab_size == 32_768
    assert TinyCausalLM(family="mistral", tokenizer_kind="tekken").model_config().vocab_size == 131_072
    assert TinyCausalLM(family="qwen2", tokenizer_kind="qwen2_bpe", vocab_size=320).model_config().vocab_size == 320


def test_unknown_family_and_kind_are_refused_together_with_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        TinyCausalLM(family="gemma7", tokenizer_kind="wordpiece")
    message = str(info.value)
    assert "family='gemma7'" in message and "'phi3'" in message and "'qwen2'" in message
    assert "tokenizer_kind='wordpiece'" in message and "'mistral_v3'" in message and "'qwen2_bpe'" in message


def test_chat_template_is_part_of_the_cache_key(data):
    plain, chat = _policy("llama", "unused", chat=False), _policy("llama", "unused", chat=True)
    chat.prompt_template = plain.prompt_template
    assert plain.model_source.cache_key(plain, data) != chat.model_source.cache_key(chat, data)
