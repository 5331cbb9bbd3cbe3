"""Chat-template prompts: rendered by the tokenizer's own template, encoded with exactly one BOS.

Local tokenizers only: trained on a few lines by the project's recipes, given a chat
template with role markers as special tokens, saved with ``save_pretrained`` and loaded
back with ``from_pretrained`` (the template travels in the saved folder). The expected
texts and ids are written out by hand from the templates below.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mrl_lightning.model.chat import (
    chat_template_errors,
    encode_rendered,
    end_of_turn_id,
    render_chat_prompt,
    tokenizer_adds_bos,
)
from mrl_lightning.errors import ConfigError
from mrl_lightning.recipes.tokenizers import train_byte_level_bpe, train_sentencepiece_bpe

CORPUS = ["What is 7 - 5?", "Calculate 12 + 34.", "You are a careful solver.", "Answer: 46"] * 20
MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A template that writes the BOS itself (as Llama 3's and Mistral's do).
WITH_BOS = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# The same format without the BOS (as Qwen2.5's, whose tokenizer adds none either).
WITHOUT_BOS = WITH_BOS.removeprefix("{{ bos_token }}")


def _tokenizer(folder, kind: str, template: str | None):
    train = train_sentencepiece_bpe if kind == "sentencepiece" else train_byte_level_bpe
    tok = train(CORPUS, 300, folder)
    tok.add_tokens(MARKERS, special_tokens=True)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def spm_with_bos(tmp_path_factory):
    """SentencePiece-style tokenizer that adds ``<s>`` itself, with a template that also writes it."""
    return _tokenizer(tmp_path_factory.mktemp("spm_bos"), "sentencepiece", WITH_BOS)


def test_fixture_tokenizer_adds_bos_and_keeps_its_template(spm_with_bos):
    assert tokenizer_adds_bos(spm_with_bos)
    assert spm_with_bos.chat_template == WITH_BOS  # survived save_pretrained / from_pretrained
    for marker in MARKERS:
        assert len(spm_with_bos(marker, add_special_tokens=False)["input_ids"]) == 1


def test_render_has_system_turn_user_turn_and_generation_prompt(spm_with_bos):
    text = render_chat_prompt(spm_with_bos, "What is 7 - 5?", "You are a careful solver.")
    assert text == "<s><|system|>You are a careful solver.<|end|><|user|>What is 7 - 5?<|end|><|assistant|>"


@pytest.mark.parametrize("system_prompt", [None, ""])
def test_render_without_system_prompt_has_no_system_turn(spm_with_bos, system_prompt):
    assert render_chat_prompt(spm_with_bos, "Calculate 12 + 34.", system_prompt) == \
        "<s><|user|>Calculate 12 + 34.<|end|><|assistant|>"


def test_plain_encode_would_double_the_bos_and_encode_rendered_does_not(spm_with_bos):
    text = render_chat_prompt(spm_with_bos, "What is 7 - 5?")
    bos = spm_with_bos.bos_token_id
    naive = spm_with_bos(text)["input_ids"]
    assert naive[:2] == [bos, bos]  # the bug this module exists for
    (ids,) = encode_rendered(spm_with_bos, [text], max_len=64)
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids == spm_with_bos(text, add_special_tokens=False)["input_ids"]


def test_template_without_bos_gets_the_tokenizers_bos_once(tmp_path):
    tok = _tokenizer(tmp_path, "sentencepiece", WITHOUT_BOS)
    text = render_chat_prompt(tok, "What is 7 - 5?")
    assert not text.startswith("<s>")
    (ids,) = encode_rendered(tok, [text], max_len=64)
    assert ids == [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text)["input_ids"]  # the same as the tokenizer's own convention


def test_tokenizer_without_bos_convention_gets_none(tmp_path):
    tok = _tokenizer(tmp_path, "byte_level", WITHOUT_BOS)
    assert not tokenizer_adds_bos(tok)
    text = render_chat_prompt(tok, "What is 7 - 5?")
    (ids,) = encode_rendered(tok, [text], max_len=64)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_truncation_keeps_the_bos_and_the_end_of_the_prompt(spm_with_bos):
    texts = [render_chat_prompt(spm_with_bos, "What is 7 - 5? " * 12), render_chat_prompt(spm_with_bos, "Hi")]
    full = [spm_with_bos(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(full[0]) > 20 >= len(full[1])
    long, short = encode_rendered(spm_with_bos, texts, max_len=20)
    assert len(long) == 20 and long[0] == spm_with_bos.bos_token_id and long[1:] == full[0][-19:]
    assert short == full[1]


def test_missing_chat_template_is_a_config_error_with_the_fix(tmp_path):
    tok = _tokenizer(tmp_path, "sentencepiece", None)
    errors = chat_template_errors("policy 'llama'", tok)
    assert len(errors) == 1 and "policy 'llama'" in errors[0] and "chat_template: false" in errors[0]
    with pytest.raises(ConfigError, match="has no chat template"):
        render_chat_prompt(tok, "What is 7 - 5?")


def test_max_len_below_two_is_refused(spm_with_bos):
    with pytest.raises(ValueError, match="max_len=1"):
        encode_rendered(spm_with_bos, ["x"], max_len=1)


def test_end_of_turn_is_the_special_token_after_the_assistant_content(spm_with_bos):
    # WITH_BOS renders "<s><|user|>x<|end|><|assistant|>PROBE<|end|>": the turn ends with <|end|>
    assert end_of_turn_id(spm_with_bos) == spm_with_bos.convert_tokens_to_ids("<|end|>")
    assert end_of_turn_id(spm_with_bos) != spm_with_bos.eos_token_id


def test_end_of_turn_is_eos_where_the_template_ends_a_turn_with_it(tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|assistant|>"
                "{% else %}{{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    tok = _tokenizer(tmp_path, "sentencepiece", template)  # the space before EOS is passed over
    assert end_of_turn_id(tok) == tok.eos_token_id


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "does not start with a special token"),
    ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "does not render an assistant message's content"),
])
def test_template_without_an_end_of_turn_token_is_a_config_error(tmp_path, template, expected):
    tok = _tokenizer(tmp_path, "byte_level", template)
    with pytest.raises(ConfigError, match=expected):
        end_of_turn_id(tok)
