"""One sampling distribution: a model's own generation config cannot change what rollouts sample.

A tiny GPT-2 is built from a config, given a ``generation_config`` that would change
sampling (the repetition penalty 1.3 Qwen2.5-Instruct-like models ship, and three other
fields), saved with ``save_pretrained`` and loaded with ``from_pretrained`` like a user's
model. The engine samples N first tokens of one prompt; their frequencies must agree with
the probabilities the old log-probs give (the training forward's ``log_softmax(logits / T)``).

Statistics: with N samples a frequency has binomial standard deviation
``sqrt(p (1 - p) / N)``; each check allows Z = 4.5 of them (two-sided p = 6.8e-6 per check;
with at most 40 checks per case the chance of a false alarm stays below 3e-4). The same
check on ``model.generate`` with the model's own config must fail (that is what the engine
did before), which shows the fixture has the power to catch the bug.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mrl_lightning.rollout import HFGenerateEngine
from mrl_lightning.rollout.hf_generate import ignored_generation_settings, own_settings_only

CORPUS = ["What is 7 - 5?\nAnswer: 2", "Calculate 12 + 34.\nAnswer: 46"]
PROMPT = "What is 7 - 5?\nAnswer:"
N, Z, T = 4000, 4.5, 0.7


def _build(folder, generation):
    """A 1-layer GPT-2 whose first token after PROMPT is "7" (a prompt token) about 1 time in 5
    and EOS about 1 time in 12; ``generation(tokenizer)`` gives its generation_config fields."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(CORPUS, folder)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for token, boost in (("7", 4.0), (tok.eos_token, 3.5)):
            w = model.transformer.wte.weight[tok.convert_tokens_to_ids(token)]
            model.transformer.ln_f.bias += boost * w / w.pow(2).sum()
    model.generation_config.update(**generation(tok))
    model.save_pretrained(str(folder))
    return AutoModelForCausalLM.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))


def _prompt_ids(tok):
    return tok(PROMPT)["input_ids"]


def _first_token_probs(model, ids) -> torch.Tensor:
    """``[V]`` float64: softmax(logits / T) of the first completion token (an independent forward)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits / T, dim=-1)


def _sample_with_engine(model, tok):
    torch.manual_seed(0)
    out = HFGenerateEngine().generate(model, tok, [_prompt_ids(tok)], num_generations=N, max_completion_length=1,
                                      temperature=T)
    return out.completion_ids[:, 0], out.old_logprobs[:, 0]


def _sample_as_before(model, tok):
    """What the engine did before: sampling kwargs on top of the model's own generation config."""
    ids = torch.tensor([_prompt_ids(tok)] * N)
    torch.manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on min_new_tokens vs max length
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=T,
                             top_p=1.0, top_k=0, max_new_tokens=1, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    return out[:, ids.shape[1]]


def _disagreements(tokens: torch.Tensor, probs: torch.Tensor) -> list[str]:
    """Bins whose frequency is more than Z binomial std away from its probability.

    Bins: every token with N p >= 10 on its own, the remaining tokens together.
    """
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    big = probs * N >= 10
    bins = [(f"token {i}", counts[i], probs[i]) for i in torch.nonzero(big).flatten().tolist()]
    bins.append(("the rest", counts[~big].sum(), probs[~big].sum()))
    bad = []
    for name, count, p in bins:
        p = float(p)
        std = math.sqrt(max(p * (1 - p), 1 / N) / N)  # floor: a bin of mass ~0 still allows ~Z/N
        if abs(float(count) / N - p) > Z * std:
            bad.append(f"{name}: sampled {float(count) / N:.4f}, log-probs say {p:.4f} (std {std:.4f})")
    return bad


CASES = {
    "repetition_penalty": lambda tok: {"repetition_penalty": 1.3},
    "no_repeat_ngram_size": lambda tok: {"no_repeat_ngram_size": 1},
    "min_new_tokens": lambda tok: {"min_new_tokens": 2},
    "bad_words_ids": lambda tok: {"bad_words_ids": [[tok.convert_tokens_to_ids("7")]]},
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model, tok = _build(tmp_path_factory.mktemp(request.param), CASES[request.param])
    return request.param, model, tok


def test_fixture_puts_real_mass_on_a_prompt_token_and_on_eos(case):
    _, model, tok = case
    probs = _first_token_probs(model, _prompt_ids(tok))
    assert 0.15 < probs[tok.convert_tokens_to_ids("7")] < 0.5
    assert 0.05 < probs[tok.eos_token_id] < 0.3


def test_sampled_first_tokens_follow_the_old_logprobs(case):
    name, model, tok = case
    probs = _first_token_probs(model, _prompt_ids(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens, old = _sample_with_engine(model, tok)
    # the old log-probs are log softmax(logits / T) of the sampled token
    torch.testing.assert_close(old.double(), probs.log()[tokens], atol=1e-5, rtol=0)
    assert _disagreements(tokens, probs) == [], name
    prompt_share = float(probs[sorted(set(_prompt_ids(tok)))].sum())
    sampled_share = float(torch.isin(tokens, torch.tensor(_prompt_ids(tok))).double().mean())
    assert abs(sampled_share - prompt_share) <= Z * math.sqrt(prompt_share * (1 - prompt_share) / N)


def test_the_models_own_config_would_have_changed_sampling(case):
    name, model, tok = case
    probs = _first_token_probs(model, _prompt_ids(tok))
    assert _disagreements(_sample_as_before(model, tok), probs), f"{name}: the check above could not fail"


def test_repetition_penalty_case_reproduces_the_reported_gap(tmp_path):
    """The case users hit: before, a prompt token came first far less often than the log-probs say."""
    model, tok = _build(tmp_path, CASES["repetition_penalty"])
    probs = _first_token_probs(model, _prompt_ids(tok))
    seven = tok.convert_tokens_to_ids("7")
    before = float((_sample_as_before(model, tok) == seven).double().mean())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        now = float((_sample_with_engine(model, tok)[0] == seven).double().mean())
    std = math.sqrt(float(probs[seven]) * (1 - float(probs[seven])) / N)
    assert before < float(probs[seven]) - 10 * std, (before, float(probs[seven]))
    assert abs(now - float(probs[seven])) <= Z * std, (now, float(probs[seven]))


def test_warning_names_the_model_and_the_ignored_keys_once(tmp_path):
    model, tok = _build(tmp_path, lambda tok: {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3})
    engine = HFGenerateEngine()
    args = dict(num_generations=2, max_completion_length=2, temperature=T)
    with pytest.warns(UserWarning) as caught:
        engine.generate(model, tok, [_prompt_ids(tok)], policy_name="qwen", **args)
    messages = [str(w.message) for w in caught if "generation_config" in str(w.message)]
    assert len(messages) == 1
    for part in ("'qwen'", str(tmp_path), "repetition_penalty=1.3", "no_repeat_ngram_size=3"):
        assert part in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(model, tok, [_prompt_ids(tok)], policy_name="qwen", **args)  # not again


def test_ignored_settings_of_an_instruct_style_config():
    from transformers import GenerationConfig

    qwen_like = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                                 bos_token_id=1, eos_token_id=[2, 3], pad_token_id=2)
    found = ignored_generation_settings(qwen_like, temperature=1.0, top_p=1.0, top_k=0)
    assert found == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert ignored_generation_settings(qwen_like, temperature=0.7, top_p=0.8, top_k=20) == {"repetition_penalty": 1.05}
    greedy = ignored_generation_settings(qwen_like, temperature=1.0, top_p=1.0, top_k=0, do_sample=False)
    assert greedy == {"repetition_penalty": 1.05}
    neutral = GenerationConfig(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0, num_beams=1)
    assert ignored_generation_settings(neutral, temperature=1.0, top_p=1.0, top_k=0) == {}
    assert ignored_generation_settings(None, temperature=1.0, top_p=1.0, top_k=0) == {}


def test_model_generation_config_is_restored_even_when_generate_fails(tmp_path):
    model, _ = _build(tmp_path, CASES["repetition_penalty"])
    saved = model.generation_config
    with pytest.raises(RuntimeError):
        with own_settings_only(model):
            assert model.generation_config is not saved and model.generation_config.repetition_penalty is None
            raise RuntimeError("generate failed")
    assert model.generation_config is saved and saved.repetition_penalty == 1.3
