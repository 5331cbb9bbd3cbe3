"""Prompts of instruction models, rendered by the tokenizer's own chat template.

An instruction-tuned model expects its prompt in the exact format it was tuned on
(role headers, special tokens, the assistant header it answers after). The tokenizer
ships that format as a Jinja chat template; :func:`render_chat_prompt` renders one user
turn (after an optional system turn) with ``apply_chat_template(...,
add_generation_prompt=True)``, as TRL's trainers do for conversational data. Base models
keep the hand-written ``str.format`` template of the policy.

Beginning of sequence. Most templates that need a BOS token emit it themselves
(``{{ bos_token }}``), and many tokenizers also add one when encoding text; encoding the
rendered text the usual way then gives two. :func:`encode_rendered` encodes without the
tokenizer's special tokens (as TRL does for rendered prompts) and puts exactly one BOS in
front when the tokenizer's own convention has one and the text did not bring it, so the
ids start with one BOS whether the template, the tokenizer, both or neither add it.

End of turn. An instruction model ends its answer with the token its template writes
after an assistant message: EOS for some (Mistral's ``</s>``), a token of its own for
others (Llama 3's ``<|eot_id|>``, Qwen2's ``<|im_end|>``, Phi-3's ``<|end|>``), which such
models list in ``generation_config.json`` next to EOS. :func:`end_of_turn_id` reads it
from the template itself, so it holds for any tokenizer, not only the recipes' own.
"""

from __future__ import annotations

from mrl_lightning.errors import ConfigError


def chat_template_errors(where: str, tokenizer) -> list[str]:
    """Problems that stop ``tokenizer`` from rendering chat prompts (for config checks).

    Args:
        where: Prefix naming the config entry, e.g. ``"policy 'qwen'"``.
        tokenizer: A Hugging Face tokenizer.

    Returns:
        Error messages (empty when the tokenizer has a chat template).
    """
    if getattr(tokenizer, "chat_template", None):
        return []
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return [f"{where}: chat_template=true but tokenizer {name!r} has no chat template. Use the tokenizer of an "
            "instruction-tuned model (tokenizer: <its folder or hub id>), or set chat_template: false and write "
            "the format in prompt_template."]


def render_chat_prompt(tokenizer, user_message: str, system_prompt: str | None = None) -> str:
    """The prompt text of one user turn in the tokenizer's chat format, ready for the answer.

    Args:
        tokenizer: A Hugging Face tokenizer with a ``chat_template``.
        user_message: Content of the user turn (the question, possibly in the policy's
            ``prompt_template``).
        system_prompt: Content of a system turn before it; None or "" = no system turn.

    Returns:
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``:
        the rendered text, ending with the assistant header the model answers after.

    Raises:
        ConfigError: the tokenizer has no chat template.
    """
    errors = chat_template_errors("render_chat_prompt", tokenizer)
    if errors:
        raise ConfigError(errors[0])
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": user_message})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_TURN_PROBE = "mrl-end-of-turn-probe"


def end_of_turn_id(tokenizer) -> int:
    """The id of the special token that ends an assistant turn in the tokenizer's chat template.

    Renders a user turn and an assistant turn whose content is a probe text, and takes the
    first token after the probe (and any whitespace the template writes before it); it must
    be a special token (EOS, or a marker of the template's own).

    Args:
        tokenizer: A Hugging Face tokenizer with a ``chat_template``.

    Returns:
        The token id (``tokenizer.eos_token_id`` for templates that end a turn with EOS).

    Raises:
        ConfigError: the tokenizer has no chat template, the template drops the assistant's
            content, or what follows it is not a special token.
    """
    errors = chat_template_errors("end_of_turn_id", tokenizer)
    if errors:
        raise ConfigError(errors[0])
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_PROBE}], tokenize=False)
    if _TURN_PROBE not in text:
        raise ConfigError(f"the chat template of tokenizer {name!r} does not render an assistant message's content "
                          f"(rendered: {text[-120:]!r}), so no end-of-turn token can be read from it. Use a template "
                          "that writes assistant turns.")
    rest = text.split(_TURN_PROBE, 1)[1].lstrip()
    ids = tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if not ids or ids[0] not in special:
        raise ConfigError(f"the chat template of tokenizer {name!r} ends an assistant turn with {rest[:40]!r}, which "
                          "does not start with a special token, so a completion has no token to stop at. Give the "
                          "template an end-of-turn token (e.g. {{ eos_token }} after the assistant's content).")
    return ids[0]


def tokenizer_adds_bos(tokenizer) -> bool:
    """True when the tokenizer's plain encode puts its BOS token first."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def encode_rendered(tokenizer, texts: list[str], max_len: int,
                    full_lengths: list[int] | None = None) -> list[list[int]]:
    """Token ids of rendered prompts with at most one BOS, left-truncated to ``max_len``.

    Texts are encoded with ``add_special_tokens=False`` (special tokens written in the
    text, such as a template's role markers, are still read as single tokens). When the
    tokenizer normally starts a sequence with BOS and a text did not bring its own, one is
    put in front. Truncation keeps the end of the prompt (the question and the assistant
    header) and, when the ids start with BOS, keeps that BOS first.

    Args:
        tokenizer: A Hugging Face tokenizer.
        texts: B rendered prompts.
        max_len: Most tokens per prompt, >= 2.
        full_lengths: If given, each prompt's length before truncation is appended to it.

    Returns:
        B lists of token ids.

    Raises:
        ValueError: ``max_len`` < 2.
    """
    if max_len < 2:
        raise ValueError(f"max_len={max_len} must be >= 2 (a BOS and at least one prompt token); "
                         "raise max_prompt_length.")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if tokenizer_adds_bos(tokenizer):
        ids = [x if x[:1] == [bos] else [bos] + x for x in ids]
    out = []
    for x in ids:
        if full_lengths is not None:
            full_lengths.append(len(x))
        if len(x) > max_len:
            x = [bos] + x[-(max_len - 1):] if bos is not None and x[0] == bos else x[-max_len:]
        out.append(x)
    return out


def completion_end_id(tokenizer, chat_template: bool) -> int:
    """The id a policy's completion ends with: its chat template's end of turn under
    ``chat_template`` (:func:`end_of_turn_id`), else the tokenizer's EOS.

    Raises:
        ConfigError: ``chat_template`` and the template has no end-of-turn token.
    """
    return end_of_turn_id(tokenizer) if chat_template else tokenizer.eos_token_id
