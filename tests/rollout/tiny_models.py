"""Tiny local models for the rollout tests, built from a config (no download), written with
``save_pretrained`` and used through ``from_pretrained`` like a user's model.

Two deliberate changes from a plain init, both to make the tests able to fail:

- ``initializer_range=0.5``: logits spread over several nats, so a missing temperature
  or a wrong position id changes log-probs by far more than the 1e-5 tolerance;
- the final layer-norm bias is pushed toward the EOS embedding, so EOS is sampled often
  enough (about one row in three at temperature 0.7) that both finish reasons occur.

The default width (32, 2 heads of 16) is the double's; vLLM's CPU build takes head sizes
from 32 up (``tests/real_vllm`` builds width 64).
"""

from __future__ import annotations

import torch

TINY_CORPUS = ["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"]


def build_tiny_gpt2(folder, dropout: float = 0.0, eos_boost: float = 4.0, seed: int = 0, width: int = 32,
                    positions: int = 64):
    """Write a tokenizer and a 1-layer GPT-2 (2 heads of ``width / 2``) to ``folder``; return the folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(TINY_CORPUS, folder)
    cfg = GPT2Config(
        vocab_size=len(tok), n_embd=width, n_layer=1, n_head=2, n_positions=positions, initializer_range=0.5,
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


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def build_tiny_chat_gpt2(folder, end_boost: float = 6.0, seed: int = 0, width: int = 32,
                         end_in_generation_config: bool = True):
    """A tiny GPT-2 chat model whose turn ends with ``<|end|>``, not EOS (as Phi-3's does).

    The tokenizer gets Phi-3-style role markers and a chat template; the saved
    ``generation_config.json`` lists ``[eos, <|end|>]`` as a chat model's does (only EOS when
    ``end_in_generation_config`` is False: the end of turn is then known from the template
    alone); the final layer-norm bias is pushed toward ``<|end|>`` so that it is sampled often
    and EOS rarely.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(TINY_CORPUS, folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    end = tok.convert_tokens_to_ids("<|end|>")
    cfg = GPT2Config(vocab_size=len(tok), n_embd=width, n_layer=1, n_head=2, n_positions=128, initializer_range=0.5,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        w = model.transformer.wte.weight[end]
        model.transformer.ln_f.bias += end_boost * w / w.pow(2).sum()
    model.generation_config.eos_token_id = [tok.eos_token_id, end] if end_in_generation_config else tok.eos_token_id
    model.save_pretrained(str(folder))
    return folder


def build_tiny_llama(folder, seed: int = 0, width: int = 64, tied: bool = False):
    """A 1-layer Llama (2 heads of ``width / 2``, one key/value head, untied LM head unless
    ``tied``) on the tokenizer of :func:`build_tiny_gpt2`, with its spread (no EOS bias:
    RMSNorm has none); return the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mrl_lightning.recipes.tokenizers import train_char_level

    tok = train_char_level(TINY_CORPUS, folder)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=0.5, tie_word_embeddings=tied, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


CROSSING = "12ĊQ"  # byte-level spelling of "12\nQ": one token holding a newline in its middle


def build_tiny_crossing_gpt2(folder, boost: float = 12.0, seed: int = 0, width: int = 32):
    """A tiny GPT-2 on a byte-level BPE whose merges make ``"12\nQ"`` one token, pushed to sample it often.

    The case stop strings must get right (docs/rollout.md, "Stop strings"): with ``stop: ["\n"]`` the
    newline ends inside a token that goes on past it. Vocabulary: the 256 byte symbols, the merges
    ``1 2``, ``Ċ Q``, ``12 ĊQ``, then ``<eos>``, ``<pad>``, ``<bos>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = [("1", "2"), ("Ċ", "Q"), ("12", "ĊQ")]
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")
    tok.save_pretrained(str(folder))
    cfg = GPT2Config(vocab_size=len(tok), n_embd=width, n_layer=1, n_head=2, n_positions=128, initializer_range=0.5,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        w = model.transformer.wte.weight[tok.convert_tokens_to_ids(CROSSING)]
        model.transformer.ln_f.bias += boost * w / w.pow(2).sum()
    model.save_pretrained(str(folder))
    return folder
