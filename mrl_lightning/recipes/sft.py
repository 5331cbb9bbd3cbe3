"""Supervised warm-start helpers: batches of (prompt, reference completion) and greedy accuracy.

Completion tokens come from THL ``retokenize`` so the warm-start teaches exactly the
token sequence the policy later receives for a peer's text (docs/thl.md). A completion
ends with the token the policy's prompt format ends a turn with (:func:`completion_end_id`):
EOS for a plain template, the chat template's end-of-turn token under ``chat_template``
(Llama 3's ``<|eot_id|>``, Qwen2's ``<|im_end|>``, ...; :func:`mrl_lightning.model.chat.end_of_turn_id`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from mrl_lightning.model.chat import completion_end_id as chat_completion_end_id
from mrl_lightning.thl import decode_completion, retokenize


def completion_end_id(policy) -> int:
    """The id a completion of ``policy`` ends with (:func:`mrl_lightning.model.chat.completion_end_id`).

    Raises:
        ConfigError: ``chat_template`` and the template has no end-of-turn token.
    """
    return chat_completion_end_id(policy.tokenizer, getattr(policy, "chat_template", False))


def encode_example(policy, prompt_text: str, completion_text: str) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids + [end])`` in the policy's tokenizer, ``end`` from :func:`completion_end_id`."""
    end = completion_end_id(policy)
    if end == policy.tokenizer.eos_token_id:
        r = retokenize(policy.tokenizer, prompt_text, completion_text, add_eos=True)
        return r.prompt_ids[-policy.max_prompt_length:], r.completion_ids
    r = retokenize(policy.tokenizer, prompt_text, completion_text)
    return r.prompt_ids[-policy.max_prompt_length:], r.completion_ids + [end]


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


LARGE_VOCAB = 4096
"""From this vocabulary size on, :func:`sft_loss` scores only the labelled positions."""


def sft_loss(model, ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL (nats/token) of the labelled tokens, as ``model(..., labels=labels).loss``.

    With a vocabulary of at least :data:`LARGE_VOCAB` tokens (a real tokenizer, 32k-131k) the
    output layer and softmax run only on the positions that predict a label (the
    completion's, about a quarter of a warm-start batch): the same terms, summed in another
    order. A small vocabulary keeps the model's own loss, bit for bit the computation of
    the warm-starts docs/default.md reports.

    Args:
        model: A Hugging Face causal LM.
        ids: ``[N, T]`` int64 input ids.
        attn: ``[N, T]`` int64, 1 = real token.
        labels: ``[N, T]`` int64, -100 = not scored.

    Returns:
        A scalar float32 tensor.
    """
    head = model.get_output_embeddings()
    if head.weight.shape[0] < LARGE_VOCAB:
        return model(input_ids=ids, attention_mask=attn, labels=labels).loss
    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state  # [N, T, H], final norm applied
    scored = labels[:, 1:] != -100
    logits = head(hidden[:, :-1][scored]).float()
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:][scored])


def texts_through_end(tokenizer, batch, end: int) -> list[str]:
    """Each completion's text up to its first ``end`` token (or EOS), which ends it.

    The rollout engine stops a completion at EOS only; under a chat format whose turn ends
    with a token of its own, what the model writes after that token is not part of its answer.

    Args:
        tokenizer: The policy's tokenizer.
        batch: A :class:`~mrl_lightning.rollout.RolloutBatch`.
        end: The end-of-turn id.

    Returns:
        N completion texts.
    """
    stops = {end, tokenizer.eos_token_id}
    texts = []
    for row, counted in zip(batch.completion_ids.tolist(), batch.completion_mask.tolist()):
        ids = [t for t, m in zip(row, counted) if m]
        cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        texts.append(decode_completion(tokenizer, ids[:cut], errors="replace"))
    return texts


@torch.no_grad()
def greedy_accuracy(policy, model, items, reward_fn=None) -> float:
    """Share of ``items`` whose greedy completion (through its end of turn) the strict verifier accepts."""
    from mrl_lightning.rewards import ReasoningGymAccuracy
    from mrl_lightning.rollout import HFGenerateEngine

    reward_fn = reward_fn or ReasoningGymAccuracy()
    out = HFGenerateEngine().generate(
        model, policy.tokenizer, policy.prompt_ids(items)[1],
        num_generations=1, max_completion_length=policy.max_completion_length, do_sample=False,
    )
    end = completion_end_id(policy)
    texts = out.completion_texts if end == policy.tokenizer.eos_token_id else texts_through_end(
        policy.tokenizer, out, end)
    scores = reward_fn(texts, items)
    return float(sum(s == 1.0 for s in scores) / max(len(items), 1))
