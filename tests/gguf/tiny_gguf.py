"""A tiny Llama written as a GGUF file by the ``gguf`` package's own writer (no download).

Two layers, width 64, 4 query heads over 2 key/value heads, a byte-level BPE of 256 byte symbols,
4 merges and an end-of-text token. Matrices are stored Q4_1 (SmolLM2's file type), the LM head
Q8_0 and the norms F32, as llama.cpp writes them: query and key rows permuted for its rotary
layout (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``), shapes in GGUF order. What a
converter should give back is the *dequantized* weights in Hugging Face's layout:
:func:`reference_state` returns them (``gguf.quants.dequantize`` of what was written).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

WIDTH, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 128
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "1")]
SPECIALS = ["<|endoftext|>"]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens (byte symbols, merges, specials) and their GGUF token types (1 normal, 3 control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + [a + b for a, b in MERGES] + SPECIALS
    return tokens, [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 source weights under Hugging Face Llama names, ``[out, in]``."""
    gen = np.random.default_rng(seed)
    vocab = len(vocabulary()[0])
    head = WIDTH // HEADS

    def mat(rows, cols):
        return (gen.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    out = {"model.embed_tokens.weight": mat(vocab, WIDTH), "lm_head.weight": mat(vocab, WIDTH),
           "model.norm.weight": (1 + 0.1 * gen.standard_normal(WIDTH)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": mat(WIDTH, WIDTH), p + "self_attn.k_proj.weight": mat(KV_HEADS * head, WIDTH),
                    p + "self_attn.v_proj.weight": mat(KV_HEADS * head, WIDTH), p + "self_attn.o_proj.weight": mat(WIDTH, WIDTH),
                    p + "mlp.gate_proj.weight": mat(FFN, WIDTH), p + "mlp.up_proj.weight": mat(FFN, WIDTH),
                    p + "mlp.down_proj.weight": mat(WIDTH, FFN),
                    p + "input_layernorm.weight": (1 + 0.1 * gen.standard_normal(WIDTH)).astype(np.float32),
                    p + "post_attention_layernorm.weight": (1 + 0.1 * gen.standard_normal(WIDTH)).astype(np.float32)})
    return out


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
              "model.norm.weight": "output_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
              "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}


def _gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def _storage(name: str):
    from gguf import GGMLQuantizationType as Q

    if name.endswith("norm.weight"):
        return Q.F32
    return Q.Q8_0 if name == "lm_head.weight" else Q.Q4_1


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the tiny Llama to ``path`` (a ``.gguf``) and return it."""
    import gguf

    tokens, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    eos = tokens.index("<|endoftext|>")
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    for name, w in hf_weights(seed).items():
        if name.endswith("q_proj.weight"):
            w = _permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, KV_HEADS)
        kind = _storage(name)
        data = gguf.quants.quantize(w, kind)
        writer.add_tensor(_gguf_name(name), data, raw_shape=data.shape if kind.name == "F32" else None,
                          raw_dtype=None if kind.name == "F32" else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """What a lossless converter gives: each written tensor dequantized, in Hugging Face's layout."""
    import gguf

    out = {}
    for name, w in hf_weights(seed).items():
        kind = _storage(name)
        out[name] = torch.from_numpy(np.array(gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind),
                                              dtype=np.float32).reshape(w.shape))
    return out


def tensor_type_counts() -> dict[str, int]:
    """How many tensors of each storage type the file holds."""
    counts: dict[str, int] = {}
    for name in hf_weights():
        counts[_storage(name).name] = counts.get(_storage(name).name, 0) + 1
    return counts
