"""The warm-start loss scores only labelled positions for a large vocabulary, with the model's own value."""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.recipes.families import build_model, model_config
from mrl_lightning.recipes.sft import LARGE_VOCAB, sft_loss


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 7), generator=g)
    attn = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 6 + [0]])
    labels = torch.full_like(ids, -100)
    labels[0, 4:7] = ids[0, 4:7]  # prompts of 4, 3 and 5 tokens; completions to each row's end
    labels[1, 3:5] = ids[1, 3:5]
    labels[2, 5:6] = ids[2, 5:6]
    return ids, attn, labels


@pytest.mark.parametrize("family", ["gpt2", "mistral", "phi3"])
def test_large_vocabulary_loss_equals_the_models_own(family):
    torch.manual_seed(0)
    model = build_model(model_config(family, LARGE_VOCAB, 16, 1, 2, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    ids, attn, labels = _batch(LARGE_VOCAB)
    ours = sft_loss(model, ids, attn, labels)
    theirs = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    # untrained: about log V nats per token (6 scored tokens), far from 0
    assert ours.item() == pytest.approx(torch.log(torch.tensor(float(LARGE_VOCAB))).item(), abs=0.5)
    ours.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_small_vocabulary_keeps_the_models_own_loss_bit_for_bit():
    torch.manual_seed(0)
    model = build_model(model_config("llama", 300, 16, 1, 2, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    ids, attn, labels = _batch(300)
    theirs = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    assert torch.equal(sft_loss(model, ids, attn, labels), theirs)
