"""Supervised warm-start helpers: batches of (prompt, reference completion) and greedy accuracy.

Completion tokens come from THL ``retokenize`` so the warm-start teaches exactly the
token sequence the policy later receives for a peer's text (docs/thl.md).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from mrl_lightning.thl import retokenize


def encode_example(policy, prompt_text: str, completion_text: str) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids + [eos])`` in the policy's tokenizer."""
    r = retokenize(policy.tokenizer, prompt_text, completion_text, add_eos=True)
    return r.prompt_ids[-policy.max_prompt_length:], r.completion_ids


def sft_batches(policy, items, batch_size: int, rng: random.Random) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless right-padded batches ``(input_ids [N, T], attention [N, T], labels [N, T])``.

    Labels are -100 on prompt and padding, so the loss is the completion NLL (nats/token).
    """
    pad = policy.tokenizer.pad_token_id
    cache: dict[str, tuple[list[int], list[int]]] = {}
    while True:
        rows = []
        for item in rng.sample(items, min(batch_size, len(items))):
            if item.prompt_id not in cache:
                cache[item.prompt_id] = encode_example(policy, policy.render_prompt(item),
                                                       policy.render_completion(item))
            rows.append(cache[item.prompt_id])
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            seq = p + c
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            labels[i, len(p): len(seq)] = torch.tensor(c)
        yield ids, attn, labels


@torch.no_grad()
def greedy_accuracy(policy, model, items, reward_fn=None) -> float:
    """Share of ``items`` whose greedy completion the strict verifier accepts."""
    from mrl_lightning.rewards import ReasoningGymAccuracy
    from mrl_lightning.rollout import HFGenerateEngine

    reward_fn = reward_fn or ReasoningGymAccuracy()
    out = HFGenerateEngine().generate(
        model, policy.tokenizer, policy.encode_prompts([policy.render_prompt(x) for x in items]),
        num_generations=1, max_completion_length=policy.max_completion_length, do_sample=False,
    )
    scores = reward_fn(out.completion_texts, items)
    return float(sum(s == 1.0 for s in scores) / max(len(items), 1))
