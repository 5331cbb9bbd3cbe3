"""How the HF engine draws tokens from each prompt's seed and reads their log-probs (rollout/draws.py).

The sampled tokens' log-probs are read one step at a time while ``generate`` runs: they must be
the very floats the old engine computed from ``generate``'s kept logits (``output_logits``).
The ``inverse_cdf`` draw must sample the softmax of the filtered scores, never a filtered-out
token, and keep a prompt's completions a function of its seed alone, as the race does.
"""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.rollout import HFGenerateEngine
from mrl_lightning.rollout.draws import _PerPromptInverseCDF, seeded_sampling
from mrl_lightning.rollout.hf_generate import own_settings_only, sampling_generation_config
from mrl_lightning.rollout.base import left_pad

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:"]
G, L, T = 4, 6, 0.7


def _old_engine_logprobs(model, tok, seeds, do_sample: bool):
    """The engine before rollout/draws.py: generate keeps every step's logits, log-probs taken after."""
    ids, mask = left_pad([tok(p)["input_ids"] for p in PROMPTS for _ in range(G if do_sample else 1)],
                         tok.pad_token_id)
    config = sampling_generation_config(max_new_tokens=L, do_sample=False, temperature=T, top_p=1.0, top_k=0,
                                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    config.output_logits = True
    processors = seeded_sampling(seeds, len(PROMPTS), G, T, 1.0, 0) if do_sample else None
    with torch.no_grad(), own_settings_only(model):
        out = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config,
                             logits_processor=processors)
    completion = out.sequences[:, ids.shape[1]:]
    steps = []
    for t, logits in enumerate(out.logits):
        scaled = logits.float() / T
        steps.append(scaled.gather(1, completion[:, t].unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, dim=-1))
    return completion, torch.stack(steps, dim=1)


@pytest.mark.parametrize("do_sample", [True, False])
def test_log_probs_read_during_generate_are_the_kept_logits_ones_bit_for_bit(tiny_lm, do_sample):
    model, tok = tiny_lm
    seeds = [11, 12]
    new = HFGenerateEngine().generate(model, tok, [tok(p)["input_ids"] for p in PROMPTS], num_generations=G if
                                      do_sample else 1, max_completion_length=L, temperature=T, do_sample=do_sample,
                                      prompt_seeds=seeds if do_sample else None, share_prompt_prefill=False)
    completion, logp = _old_engine_logprobs(model, tok, seeds, do_sample)
    assert torch.equal(new.completion_ids[new.completion_mask], completion[new.completion_mask])
    assert torch.equal(new.old_logprobs[new.completion_mask], logp[new.completion_mask])


def test_inverse_cdf_draws_follow_the_softmax_of_the_filtered_scores():
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    scores = probs.log().unsqueeze(0).repeat(20000, 1)  # one prompt, 20,000 rows; the last token filtered (-inf)
    out = _PerPromptInverseCDF([7], 20000)(None, scores)
    assert torch.all(torch.isinf(out).sum(1) == 4) and torch.all(out.max(1).values == 0)
    drawn = torch.bincount(out.argmax(1), minlength=5).double() / 20000
    sigma = (probs * (1 - probs) / 20000).sqrt().double()
    assert torch.all((drawn - probs.double()).abs() <= 4 * sigma + 1e-12), drawn  # a filtered token: never
    again = _PerPromptInverseCDF([7], 20000)(None, scores)
    assert torch.equal(out, again)  # the seed alone decides


@pytest.mark.parametrize("draw", ["race", "inverse_cdf"])
def test_a_prompts_completions_depend_only_on_its_seed(tiny_lm, draw):
    model, tok = tiny_lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]

    def sample(prompts, seeds):
        return HFGenerateEngine().generate(model, tok, prompts, num_generations=G, max_completion_length=L,
                                           temperature=T, prompt_seeds=seeds, sampling_draw=draw)

    both, alone = sample(ids, [5, 6]), sample(ids[1:], [6])
    width = alone.completion_ids.shape[1]
    assert torch.equal(both.completion_ids[G:, :width], alone.completion_ids)
    torch.testing.assert_close(both.old_logprobs[G:, :width], alone.old_logprobs, rtol=0, atol=1e-5)
    other = sample(ids, [5, 7])
    assert not torch.equal(other.completion_ids[G:], both.completion_ids[G:])  # another seed, other draws


def test_an_unknown_draw_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="sampling_draw='gumbel'; valid: race, inverse_cdf"):
        seeded_sampling([1], 1, 2, 1.0, 1.0, 0, draw="gumbel")
