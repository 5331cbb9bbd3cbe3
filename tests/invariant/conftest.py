"""A tiny GPT-2 (1 layer, width 32) on a local char-level tokenizer (pad == eos), from a folder.

Same recipe as tests/rollout/conftest.py (kept separate: tests/ has no package to share
it from): logits spread by ``initializer_range=0.5``, dropout off, and the final
layer-norm bias pushed toward EOS so completions end at different lengths, which makes
micro-batches hold different numbers of counted tokens.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def invariant_lm_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    folder = tmp_path_factory.mktemp("invariant_tiny_gpt2")
    tok = train_char_level(["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"], folder)
    cfg = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64, initializer_range=0.5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        w = model.transformer.wte.weight[tok.eos_token_id]
        model.transformer.ln_f.bias += 4.0 * w / w.pow(2).sum()
    model.save_pretrained(str(folder))
    return folder
