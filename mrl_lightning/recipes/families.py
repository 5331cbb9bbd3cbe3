"""The model families ``TinyCausalLM`` builds: each one's ``transformers`` config and chat format.

A family is an architecture (a ``transformers`` config class and its ``*ForCausalLM``) and
the chat format of its instruction-tuned models. The tokenizer is chosen apart
(``tokenizer_kind``, :mod:`mrl_lightning.recipes.tokenizers`); the chat format adds the
special tokens it needs to whichever tokenizer the family is given.

| family | class | chat format | end of turn |
|---|---|---|---|
| ``gpt2`` | ``GPT2LMHeadModel`` | plain ``User:`` / ``Assistant:`` labels (GPT-2 has no instruct model) | EOS |
| ``llama`` | ``LlamaForCausalLM`` | Llama 3 role headers | ``<|eot_id|>`` |
| ``qwen2`` | ``Qwen2ForCausalLM`` | Qwen2 ChatML | ``<|im_end|>`` |
| ``mistral`` | ``MistralForCausalLM`` | Mistral ``[INST] ... [/INST]`` | EOS |
| ``phi3`` | ``Phi3ForCausalLM`` | Phi-3 ``<|user|>`` / ``<|assistant|>`` | ``<|end|>`` |

EOS is whatever the tokenizer kind's EOS is (``</s>``, ``<|endoftext|>``).

Where the family's real instruct models end a turn with a token of their own (Llama 3's
``<|eot_id|>`` beside ``<|end_of_text|>``, Qwen2's ``<|im_end|>`` beside ``<|endoftext|>``,
Phi-3's ``<|end|>`` beside ``<|endoftext|>``), the format does too, and the saved
``generation_config.json`` lists both ids in ``eos_token_id``, as those models' do.
Mistral's markers ``[INST]`` / ``[/INST]`` are not added: the Mistral v3 and Tekken
tokenizers hold them as control tokens, the others read them as plain text (as
Mistral 7B v0.1 did); its turn ends with EOS.

Phi-3 is the fifth family because its class is Llama's with fused projections (no
soft-capping, extra norms or embedding scale as in Gemma 2) and its turn ends with a
token other than EOS (OLMo 2's instruct models end theirs with EOS).
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "phi3")

# Rendered as transformers renders chat templates (trim_blocks: a newline right after a block
# tag is dropped, so every newline below stands before a tag or after an expression).
_BOS = "{% if bos_token %}{{ bos_token }}{% endif %}"
_GPT2 = ("{% for m in messages %}"
         "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
         "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
         "{% elif m['role'] == 'assistant' %}Assistant:{{ m['content'] }}{{ eos_token }}\n"
         "{% else %}{{ raise_exception('gpt2 chat format: unknown role ' ~ m['role']) }}{% endif %}"
         "{% endfor %}"
         "{% if add_generation_prompt %}Assistant:{% endif %}")
_LLAMA = (_BOS + "{% for m in messages %}"
          "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
          "{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
_QWEN2 = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The system turn goes in front of the first user message; [/INST] is itself the cue to answer.
_MISTRAL = (_BOS + "{% set turn = namespace(system='') %}"
            "{% for m in messages %}"
            "{% if m['role'] == 'system' %}{% set turn.system = m['content'] ~ '\\n\\n' %}"
            "{% elif m['role'] == 'user' %}[INST]{{ turn.system }}{{ m['content'] }}[/INST]"
            "{% set turn.system = '' %}"
            "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
            "{% else %}{{ raise_exception('mistral chat format: unknown role ' ~ m['role']) }}{% endif %}"
            "{% endfor %}")
_PHI3 = ("{% for m in messages %}"
         "{% if m['role'] in ['system', 'user', 'assistant'] %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
         "{% else %}{{ raise_exception('phi3 chat format: unknown role ' ~ m['role']) }}{% endif %}"
         "{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class ChatFormat:
    """A family's chat format.

    Attributes:
        template: The Jinja ``chat_template`` saved with the tokenizer.
        end_of_turn: The special token that ends an assistant turn; None = the tokenizer's EOS.
        special_tokens: Tokens the template writes that must be single special tokens
            (added to the vocabulary where absent), the end of turn among them.
    """

    template: str
    end_of_turn: str | None
    special_tokens: tuple[str, ...]


CHAT_FORMATS = {
    "gpt2": ChatFormat(_GPT2, None, ()),
    "llama": ChatFormat(_LLAMA, "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "qwen2": ChatFormat(_QWEN2, "<|im_end|>", ("<|im_start|>", "<|im_end|>")),
    "mistral": ChatFormat(_MISTRAL, None, ()),
    "phi3": ChatFormat(_PHI3, "<|end|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
}


def chat_corpus_text(family: str, user_message: str, completion: str, system_prompt: str | None = None) -> str:
    """A conversation in ``family``'s chat format as plain text, for training a tokenizer on.

    The template is rendered as ``apply_chat_template`` renders it, with empty BOS / EOS and
    the format's special tokens removed: they join the vocabulary whole, the rest (role
    names, labels, line breaks) is text the tokenizer should learn to cut.

    Args:
        family: One of :data:`FAMILIES`.
        user_message: The user turn (the policy's ``prompt_template`` filled in).
        completion: The assistant's answer.
        system_prompt: A system turn before the user turn; None or "" = none.

    Raises:
        ValueError: unknown family.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    if family not in CHAT_FORMATS:
        raise ValueError(f"family={family!r} has no chat format; valid: {list(CHAT_FORMATS)}.")
    fmt = CHAT_FORMATS[family]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": "user", "content": user_message}, {"role": "assistant", "content": completion}]
    (text,), _ = render_jinja_template(conversations=[messages], chat_template=fmt.template, bos_token="",
                                       eos_token="")
    for token in fmt.special_tokens:
        text = text.replace(token, "")
    return text


def apply_chat_format(tokenizer, family: str) -> tuple[int, int]:
    """Give ``tokenizer`` the chat format of ``family``: its special tokens and its template (in place).

    Args:
        tokenizer: A Hugging Face fast tokenizer with an EOS token.
        family: One of :data:`FAMILIES`.

    Returns:
        ``(end_of_turn_id, eos_token_id)``, equal where the turn ends with EOS.

    Raises:
        ValueError: unknown family, or the tokenizer has no EOS token.
    """
    if family not in CHAT_FORMATS:
        raise ValueError(f"family={family!r} has no chat format; valid: {list(CHAT_FORMATS)}.")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the {family} chat format ends a turn after the tokenizer's EOS, but "
                         f"{type(tokenizer).__name__} has none; give it one (eos_token).")
    fmt = CHAT_FORMATS[family]
    vocab = tokenizer.get_vocab()
    missing = [t for t in fmt.special_tokens if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.chat_template = fmt.template
    eot = tokenizer.eos_token_id if fmt.end_of_turn is None else tokenizer.convert_tokens_to_ids(fmt.end_of_turn)
    return eot, tokenizer.eos_token_id


_CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
                   "phi3": "Phi3Config"}
# set by the recipe's own arguments or by the tokenizer, never by an override
_OWN_KEYS = {"vocab_size": "the tokenizer", "hidden_size": "hidden_size", "n_embd": "hidden_size",
             "num_hidden_layers": "num_layers", "n_layer": "num_layers", "num_attention_heads": "num_heads",
             "n_head": "num_heads", "bos_token_id": "the tokenizer", "eos_token_id": "the tokenizer",
             "pad_token_id": "the tokenizer", "model_type": "family"}


def config_override_errors(family: str, overrides: dict) -> list[str]:
    """Problems of ``TinyCausalLM.config_overrides`` for ``family``: keys its config class does not take,
    keys the recipe's own arguments set.

    Args:
        family: One of :data:`FAMILIES`.
        overrides: Config keys and values.

    Returns:
        Error messages naming the key and the fix (empty when valid).
    """
    import difflib
    import inspect

    import transformers

    cls = getattr(transformers, _CONFIG_CLASSES[family])
    valid = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    valid |= set(cls().to_dict())
    errors = []
    for key in overrides:
        if key in _OWN_KEYS:
            errors.append(f"TinyCausalLM.config_overrides.{key} is set by {_OWN_KEYS[key]}; "
                          + ("set it there." if _OWN_KEYS[key] != "the tokenizer" else "drop it."))
        elif key not in valid:
            near = difflib.get_close_matches(key, sorted(valid), n=3)
            errors.append(f"TinyCausalLM.config_overrides.{key} is not a {cls.__name__} key"
                          + (f"; did you mean {', '.join(near)}?" if near else
                             f"; valid keys include {', '.join(sorted(valid)[:12])}, ..."))
    return errors


def model_config(family: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 overrides: dict | None = None, **token_ids):
    """The ``transformers`` config of a tiny ``family`` model (2-layer scale, 256 positions, no dropout).

    Llama-like families use an MLP of twice the width and tied embeddings (the embedding
    matrix dominates a tiny model's size); Qwen2 and Mistral use grouped-query attention
    with half as many key/value heads (as their real models do), when ``num_heads`` is even.
    ``overrides`` replace any of these (e.g. a real model's MLP ratio, key/value heads,
    RoPE base or positions: ``intermediate_size``, ``num_key_value_heads``,
    ``rope_parameters``, ``max_position_embeddings``; GPT-2's positions are ``n_positions``).

    Args:
        family: One of :data:`FAMILIES`.
        vocab_size: V.
        hidden_size: Width.
        num_layers: Transformer layers.
        num_heads: Attention heads (``hidden_size`` divisible by it).
        overrides: Config keys set over the recipe's own (:func:`config_override_errors`).
        **token_ids: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` (None when absent).

    Raises:
        ValueError: unknown family.
    """
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    extra = dict(overrides or {})
    if family == "gpt2":
        return GPT2Config(**{**dict(vocab_size=vocab_size, n_positions=256, n_embd=hidden_size, n_layer=num_layers,
                                    n_head=num_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), **extra,
                             **token_ids})
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, max_position_embeddings=256,
                  tie_word_embeddings=True, **token_ids)
    grouped = num_heads // 2 if num_heads % 2 == 0 else num_heads
    if family == "llama":
        return LlamaConfig(**{**common, "num_key_value_heads": num_heads, **extra})
    if family == "qwen2":
        return Qwen2Config(**{**common, "num_key_value_heads": grouped, "use_sliding_window": False, **extra})
    if family == "mistral":
        return MistralConfig(**{**common, "num_key_value_heads": grouped, "sliding_window": None, **extra})
    if family == "phi3":
        positions = extra.get("max_position_embeddings", 256)
        return Phi3Config(**{**common, "num_key_value_heads": num_heads, "original_max_position_embeddings": positions,
                             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, **extra})
    raise ValueError(f"family={family!r} is unknown; valid: {list(FAMILIES)}.")


def max_positions(config) -> int | None:
    """The most positions a model of ``config`` takes (``max_position_embeddings`` or GPT-2's ``n_positions``)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def build_model(config):
    """The ``*ForCausalLM`` of ``config``, randomly initialised from torch's generator."""
    from transformers import (
        GPT2LMHeadModel,
        LlamaForCausalLM,
        MistralForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
    )

    classes = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
               "mistral": MistralForCausalLM, "phi3": Phi3ForCausalLM}
    return classes[config.model_type](config)
