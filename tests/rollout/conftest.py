"""A tiny GPT-2 on a local character-level tokenizer (pad == eos), saved and loaded back.

The model is built from a config (no download), written with ``save_pretrained`` and
used through ``from_pretrained`` like a user's model. Two deliberate changes from a
plain init, both to make the tests able to fail:

- ``initializer_range=0.5``: logits spread over several nats, so a missing temperature
  or a wrong position id changes log-probs by far more than the 1e-5 tolerance;
- the final layer-norm bias is pushed toward the EOS embedding, so EOS is sampled often
  enough (about one row in three at temperature 0.7) that both finish reasons occur.
"""

from __future__ import annotations

import pytest
import torch

TINY_CORPUS = ["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"]


def build_tiny_gpt2(folder, dropout: float = 0.0, eos_boost: float = 4.0, seed: int = 0):
    """Write a tokenizer and a 1-layer GPT-2 (width 32) to ``folder``; return the folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(TINY_CORPUS, folder)
    cfg = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64, initializer_range=0.5,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        w = model.transformer.wte.weight[tok.eos_token_id]
        model.transformer.ln_f.bias += eos_boost * w / w.pow(2).sum()
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def build_tiny_lm():
    """The builder itself, for a test that needs a variant (e.g. with dropout)."""
    return build_tiny_gpt2


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.mktemp("rollout_tiny_gpt2"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_lm_dir):
    """(model, tokenizer) loaded with from_pretrained; treat as read-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)), AutoTokenizer.from_pretrained(str(tiny_lm_dir))


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def build_tiny_chat_gpt2(folder, end_boost: float = 6.0, seed: int = 0):
    """A tiny GPT-2 chat model whose turn ends with ``<|end|>``, not EOS (as Phi-3's does).

    The tokenizer gets Phi-3-style role markers and a chat template; the saved
    ``generation_config.json`` lists ``[eos, <|end|>]`` as a chat model's does; the final
    layer-norm bias is pushed toward ``<|end|>`` so that it is sampled often and EOS rarely.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(TINY_CORPUS, folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    end = tok.convert_tokens_to_ids("<|end|>")
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128, initializer_range=0.5,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        w = model.transformer.wte.weight[end]
        model.transformer.ln_f.bias += end_boost * w / w.pow(2).sum()
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    return build_tiny_chat_gpt2(tmp_path_factory.mktemp("rollout_tiny_chat"))
