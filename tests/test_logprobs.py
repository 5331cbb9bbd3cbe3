"""Log-probs and entropy with the vocabulary in chunks (mrl_lightning.model.logprobs).

Below ``LOGPROB_CHUNK_ELEMENTS`` logits a call computes exactly what the policy computed
before chunking existed (the old code is written out below): the embedded default's models at
its batch size get the same bits, gradients included. Above it, the chunked path must agree
with the plain computation within float rounding for every chunk size, prompt sharing on and
off, softcapped logits, and under bf16 autocast; and its forward must keep no logits of the
whole batch for the backward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM)

import mrl_lightning.model.logprobs as logprobs_module
from mrl_lightning.model.forward import completion_logits
from mrl_lightning.model.logprobs import LOGPROB_CHUNK_ELEMENTS, completion_logprobs
from mrl_lightning.policy import PolicyModule

DEFAULT_MODELS = Path(__file__).resolve().parents[1] / "models" / "default"
V = 1031


def _old_completion_logprobs(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, with_entropy):
    """PolicyModule.completion_logprobs as it was before chunking (2e5bc63), verbatim."""
    logits = completion_logits(policy.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               share_prompts=policy.share_prompt_forward and not (policy.gradient_checkpointing
                                                                                 or policy.fsdp),
                               ).float() / policy.temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = torch.gather(logits, 2, completion_ids.unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def _rows(vocab: int, prompts: int, g: int, p: int, length: int, seed: int = 0):
    """Prompt-major rows: ``prompts`` distinct left-padded prompts x ``g``, completions ending early."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (prompts, p), generator=gen).repeat_interleave(g, 0)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    prompt_mask[g:2 * g, :2] = False  # the second prompt is shorter (left padding)
    completion_ids = torch.randint(3, vocab, (prompts * g, length), generator=gen)
    lengths = torch.randint(1, length + 1, (prompts * g,), generator=gen)
    completion_mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _run(fn, model, rows, weights):
    model.zero_grad(set_to_none=True)
    logp, entropy = fn()
    (logp * weights * rows[3]).sum().backward()
    return logp.detach(), entropy, _grads(model)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_default_models_at_its_batch_size_get_the_old_log_probs_and_gradients_bit_for_bit(family, monkeypatch):
    policy = PolicyModule(name=family, model=str(DEFAULT_MODELS / family), temperature=1.0, num_generations=8)
    policy.model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODELS / family))
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    rows = _rows(vocab, 16, 8, 12, 8)  # the default: 16 prompts x 8 completions x 8 new tokens
    assert rows[2].numel() * vocab <= LOGPROB_CHUNK_ELEMENTS

    def no_chunks(*args, **kwargs):
        raise AssertionError("the default's sizes must take the plain computation")

    monkeypatch.setattr(logprobs_module, "chunked_token_logprobs", no_chunks)
    weights = torch.linspace(-1.0, 1.0, rows[2].numel()).view(rows[2].shape)
    new = _run(lambda: policy.completion_logprobs(*rows, with_entropy=True), policy.model, rows, weights)
    old = _run(lambda: _old_completion_logprobs(policy, *rows, with_entropy=True), policy.model, rows, weights)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert len(new[2]) == len(old[2]) > 0 and all(torch.equal(a, b) for a, b in zip(new[2], old[2]))


def _model(family: str, **extra):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                          initializer_range=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if family == "gemma2":  # softcapped logits
        return Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                              final_logit_softcapping=3.0, initializer_range=0.5, **extra))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                         initializer_range=0.5))
    if family == "llama-bias":  # an untied head with a bias
        model.lm_head = torch.nn.Linear(32, V, bias=True)
        torch.nn.init.normal_(model.lm_head.weight, std=0.5)
        torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    if family == "llama-wrapped":  # a head module that is not a plain Linear (as LoRA's wrappers): checkpointed chunks
        model.lm_head = _Wrapped(model.lm_head)
    return model


class _Wrapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "llama-bias", "llama-wrapped"])
@pytest.mark.parametrize("share", [True, False])
def test_chunked_log_probs_entropy_and_gradients_match_the_plain_computation_for_every_chunk_size(family, share):
    model = _model(family)
    rows = _rows(V, 3, 4, 6, 7)
    mask = rows[3]
    weights = torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape)
    plain = _run(lambda: completion_logprobs(model, *rows, temperature=0.7, share_prompts=share, with_entropy=True,
                                             allow_chunks=False), model, rows, weights)
    assert (plain[0][mask] - plain[0][mask].mean()).abs().max() > 0.5  # log-probs do vary
    for positions in (1, 5, 13, int(mask.sum())):  # one position a chunk ... all in one chunk
        chunked = _run(lambda: completion_logprobs(model, *rows, temperature=0.7, share_prompts=share,
                                                   with_entropy=True, chunk_elements=positions * V), model, rows,
                       weights)
        torch.testing.assert_close(chunked[0][mask], plain[0][mask], rtol=0, atol=2e-5)
        torch.testing.assert_close(chunked[1][mask], plain[1][mask], rtol=0, atol=5e-5)
        assert torch.all(chunked[0][~mask] == 0)  # positions not counted are not computed
        assert len(chunked[2]) == len(plain[2])
        for a, b in zip(chunked[2], plain[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("family", ["llama", "llama-wrapped"])
def test_the_chunked_forward_keeps_no_logits_of_the_whole_batch_for_the_backward(family):
    model = _model(family)
    rows = _rows(V, 3, 4, 6, 7)
    saved: list[int] = []
    weights = {p.data_ptr() for p in model.parameters()}

    def pack(t):
        if t.data_ptr() not in weights:  # weights are saved whole by every layer; activations are what grows
            saved.append(t.numel())
        return t

    chunk = 5 * V
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = completion_logprobs(model, *rows, temperature=0.7, chunk_elements=chunk)
    assert saved and max(saved) < chunk  # activations and indices only: no [rows, L, V], not even a chunk's
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        completion_logprobs(model, *rows, temperature=0.7, allow_chunks=False)
    assert max(saved) >= rows[2].numel() * V  # the plain computation keeps the whole batch's logits
    (logp * rows[3]).sum().backward()  # the chunked backward recomputes each chunk
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "llama-wrapped"])
def test_under_bf16_autocast_the_chunks_run_the_head_in_the_autocast_dtype(family):
    model = _model(family)
    rows = _rows(V, 3, 4, 6, 7)
    mask = rows[3]
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, *rows, temperature=0.7, allow_chunks=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain, _ = completion_logprobs(model, *rows, temperature=0.7, allow_chunks=False)
            chunked, _ = completion_logprobs(model, *rows, temperature=0.7, chunk_elements=5 * V)
    gap = (plain - fp32)[mask].abs().max()
    assert gap > 1e-3  # bf16 logits do differ from float32 ...
    assert (chunked - plain)[mask].abs().max() < gap / 4  # ... and the chunks' head ran in bf16 as the model's does


class _ScaledLogits(LlamaForCausalLM):
    """A model whose logits are its head's output times 2 (as some architectures scale them)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def test_a_model_whose_logits_are_not_its_head_output_falls_back_to_the_plain_computation(recwarn):
    torch.manual_seed(0)
    model = _ScaledLogits(_model("llama").config)
    rows = _rows(V, 3, 4, 6, 7)
    with torch.no_grad():
        plain, _ = completion_logprobs(model, *rows, temperature=0.7, allow_chunks=False)
        chunked, _ = completion_logprobs(model, *rows, temperature=0.7, chunk_elements=5 * V)
    assert torch.equal(chunked, plain)
    assert any("_ScaledLogits" in str(w.message) for w in recwarn)


def test_the_policy_option_sets_the_threshold_and_null_keeps_whole_logits(monkeypatch):
    from mrl_lightning.errors import ConfigError

    policy = PolicyModule(name="p", model=str(DEFAULT_MODELS / "gpt2"), logprob_chunk_elements=10)
    assert PolicyModule(name="p", model=str(DEFAULT_MODELS / "gpt2")).logprob_chunk_elements == LOGPROB_CHUNK_ELEMENTS
    policy.model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODELS / "gpt2"))
    rows = _rows(policy.model.get_output_embeddings().weight.shape[0], 2, 2, 5, 3)
    seen = []
    real = logprobs_module.chunked_token_logprobs
    monkeypatch.setattr(logprobs_module, "chunked_token_logprobs", lambda *a, **k: seen.append(k) or real(*a, **k))
    with torch.no_grad():
        policy.completion_logprobs(*rows)
        policy.logprob_chunk_elements = None
        policy.completion_logprobs(*rows)
    assert [k["chunk_elements"] for k in seen] == [10]  # chunks of one position at 10 logits; null: none
    with pytest.raises(ConfigError, match="logprob_chunk_elements=0 must be >= 1"):
        PolicyModule(name="p", model=str(DEFAULT_MODELS / "gpt2"), logprob_chunk_elements=0)


def test_one_chunk_keeps_its_logits_for_the_backward_with_the_recomputed_bits():
    from mrl_lightning.model.logprobs import _LinearHeadChunks

    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(7, 16, generator=g, requires_grad=True)
    ids = torch.randint(0, 300, (7,), generator=g)
    weights = torch.randn(7, generator=g)
    grads = []
    for rows in (8, 8):  # n = 7 <= rows: one chunk, kept; the second backward of the graph recomputes
        logp, _ = _LinearHeadChunks.apply(hidden, head.weight, None, ids, 0.7, None, rows, torch.float32, False)
        loss = (logp * weights).sum()
        first = torch.autograd.grad(loss, (hidden, head.weight), retain_graph=True)  # the kept logits
        second = torch.autograd.grad(loss, (hidden, head.weight))  # kept ones used up: computed again
        grads.append((first, second))
    for (a_h, a_w), (b_h, b_w) in grads:
        assert torch.equal(a_h, b_h) and torch.equal(a_w, b_w)
    # and the kept path agrees with several chunks (another summation order) within rounding
    logp, _ = _LinearHeadChunks.apply(hidden, head.weight, None, ids, 0.7, None, 3, torch.float32, False)
    c_h, c_w = torch.autograd.grad((logp * weights).sum(), (hidden, head.weight))
    torch.testing.assert_close(c_h, grads[0][0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_w, grads[0][0][1], rtol=1e-5, atol=1e-6)
