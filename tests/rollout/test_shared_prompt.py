"""Each distinct prompt runs once (mrl_lightning.model.forward): same numbers as the plain passes.

The training forward (``completion_logits``) and sampling (``shared_prefix_cache`` behind
the HF engine) share each prompt's KV cache across its G completions. On left-padded
prompts of different lengths, with completions that end early (padded after EOS), the
log-probs and gradients must match the plain pass over prompt + completion per row, and
sampling must draw the same tokens from the same seed.
"""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.model.forward import completion_logits
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "ab"]
G, L = 4, 6


@pytest.fixture(scope="module")
def sampled(tiny_lm):
    model, tok = tiny_lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    out = {}
    for share in (True, False):
        torch.manual_seed(11)
        out[share] = HFGenerateEngine().generate(model, tok, ids, num_generations=G, max_completion_length=L,
                                                 temperature=0.7, share_prompt_prefill=share)
    return out


def test_shared_prefill_samples_the_same_tokens_with_the_same_log_probs(sampled):
    shared, plain = sampled[True], sampled[False]
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert set(plain.finish_reasons) == {"stop", "length"}  # rows end early: pads follow EOS
    torch.testing.assert_close(shared.old_logprobs, plain.old_logprobs, rtol=1e-5, atol=1e-5)


def test_shared_prompt_forward_matches_the_plain_pass_in_values_and_gradients(tiny_lm, sampled):
    model, _ = tiny_lm
    r = sampled[False]
    results = {}
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logits = completion_logits(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                   share_prompts=share).float()
        logp = torch.gather(logits.log_softmax(-1), 2, r.completion_ids.unsqueeze(-1)).squeeze(-1)
        weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)  # a loss that weighs every token
        (logp * weights * r.completion_mask).sum().backward()
        results[share] = (logp.detach(), [p.grad.clone() for p in model.parameters()])
    (shared, g_shared), (plain, g_plain) = results[True], results[False]
    torch.testing.assert_close(shared[r.completion_mask], plain[r.completion_mask], rtol=0, atol=1e-5)
    assert (plain[r.completion_mask] - plain[r.completion_mask].mean()).abs().max() > 0.1  # log-probs do vary
    # Both passes sum the same per-token terms in another order, so an element's rounding is of the
    # order of float32's epsilon (1.2e-7) times the size of the terms it sums, which the tensor's
    # largest gradient bounds, not of the element itself (a near-zero sum of large terms carries
    # their rounding: 1.45e-6 seen on an AVX2 CPU next to gradients of ~1). Tolerance: 1e-5 of the
    # tensor's largest entry (~100 epsilons), and 1e-4 relative; a real difference (a wrong mask, a
    # missed position) moves whole gradients by far more.
    for a, b in zip(g_shared, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    model.zero_grad(set_to_none=True)


def test_rows_with_distinct_prompts_take_the_plain_pass(tiny_lm, sampled):
    model, _ = tiny_lm
    r = sampled[False]
    rows = torch.arange(0, len(PROMPTS) * G, G)  # one row per prompt: nothing to share
    with torch.no_grad():
        a = completion_logits(model, r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                              r.completion_mask[rows])
        b = completion_logits(model, r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows],
                              r.completion_mask[rows], share_prompts=False)
    assert torch.equal(a, b)
