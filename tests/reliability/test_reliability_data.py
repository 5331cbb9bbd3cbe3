"""Hostile data files, prompt ids, tokenizers and templates (docs/reliability.md, "Data, tokenizers, templates")."""

from __future__ import annotations

import json

import pytest

from mrl_lightning.model.chat import encode_rendered, render_chat_prompt
from mrl_lightning.data import MathDataModule, PromptDataModule, PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.policy import PolicyModule

ROWS = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(6)]


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _module(path):
    return MathDataModule(parts=[{"name": "gsm", "path": str(path), "answer_pattern": r"####\s*(.+?)\s*$"}],
                          batch_size=2)


def test_malformed_jsonl_line_is_an_error_naming_the_file_and_line(tmp_path):
    lines = [json.dumps(r) for r in ROWS]
    lines[3] = lines[3][:-1]  # a line cut short: no closing brace
    path = _write_jsonl(tmp_path / "train.jsonl", lines)
    with pytest.raises(ConfigError) as info:
        _module(path).setup()
    msg = str(info.value)
    assert "data.parts[gsm].path" in msg and str(path) in msg and "line 4 is not valid JSON" in msg
    assert "Fix or delete that line" in msg


def test_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    lines = [json.dumps(r) for r in ROWS]
    lines[1] = json.dumps(["What is 1 + 1?", "#### 2"])
    with pytest.raises(ConfigError, match="line 2 is a JSON list, not an object"):
        _module(_write_jsonl(tmp_path / "train.jsonl", lines)).setup()


def test_malformed_json_file_names_the_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(ROWS, indent=1).replace('"answer"', 'answer', 1))
    with pytest.raises(ConfigError, match=r"train.json' line \d+ column \d+ is not valid JSON"):
        _module(path).setup()


class _Fixed(PromptDataModule):
    """A data module that yields the prompts it is given (a user's own module)."""

    def __init__(self, train, batch_size=2):
        super().__init__(batch_size, seed=0)
        self.parts = [type("P", (), {"name": "x", "weight": 1.0})()]
        self._items = train

    def setup(self, stage=None):
        self._train = {"x": list(self._items)}

    def fingerprint(self):
        return "fixed"


def test_prompt_id_naming_two_different_prompts_is_refused():
    items = [PromptItem("x/0", "What is 1 + 1?", "2", "x", {}), PromptItem("x/1", "What is 2 + 2?", "4", "x", {}),
             PromptItem("x/0", "What is 3 + 3?", "6", "x", {})]
    with pytest.raises(ConfigError) as info:
        _Fixed(items).next_batch()
    msg = str(info.value)
    assert "prompt id 'x/0' names two different prompts" in msg and "What is 3 + 3?" in msg and "unique" in msg


def test_the_same_prompt_listed_twice_under_one_id_is_allowed():
    item = PromptItem("x/0", "What is 1 + 1?", "2", "x", {})
    assert [x.prompt_id for x in _Fixed([item, PromptItem("x/0", item.question, "2", "x", {})]).next_batch()] == \
        ["x/0", "x/0"]


def test_built_in_data_module_checks_its_ids_in_setup(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [json.dumps(r) for r in ROWS])
    module = _module(path)
    module.setup()
    assert module._ids_checked


def _strip_special(folder, key):
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg[key] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    special = folder / "special_tokens_map.json"
    if special.exists():
        data = json.loads(special.read_text())
        data.pop(key, None)
        special.write_text(json.dumps(data))


def _copy_tokenizer(src, dst):
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst


def test_tokenizer_without_eos_is_refused_with_the_fix(tiny_lm_folder, tmp_path):
    folder = _copy_tokenizer(tiny_lm_folder, tmp_path / "noeos")
    _strip_special(folder, "eos_token")
    with pytest.raises(ConfigError) as info:
        PolicyModule(name="p", model=str(tiny_lm_folder), tokenizer=str(folder))
    msg = str(info.value)
    assert "has no EOS token (eos_token=None)" in msg and "add_special_tokens({'eos_token'" in msg


def test_tokenizer_without_pad_suggests_its_eos_text(tiny_lm_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = _copy_tokenizer(tiny_lm_folder, tmp_path / "nopad")
    _strip_special(folder, "pad_token")
    eos = AutoTokenizer.from_pretrained(str(folder)).eos_token
    with pytest.raises(ConfigError, match=f"has no pad token. Set pad_token.*pad_token: {eos!r}"):
        PolicyModule(name="p", model=str(tiny_lm_folder), tokenizer=str(folder))
    policy = PolicyModule(name="p", model=str(tiny_lm_folder), tokenizer=str(folder), pad_token=eos)
    assert policy.tokenizer.pad_token == eos


def _without_tokenizer_files(tiny_lm_folder, folder):
    import shutil

    folder.mkdir()
    for file in tiny_lm_folder.iterdir():  # the model's files only: config, generation config, weights
        if not file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_")):
            shutil.copy(file, folder / file.name)
    return folder


def test_model_folder_without_tokenizer_files_names_the_missing_files(tiny_lm_folder, tmp_path):
    """transformers built a one-token tokenizer from such a folder: the check said "no pad token", and with
    pad_token set, "raise max_prompt_length". The files the folder's config implies are named instead."""
    folder = _without_tokenizer_files(tiny_lm_folder, tmp_path / "no_tokenizer")
    for extra in ({}, {"pad_token": "<eos>"}):
        with pytest.raises(ConfigError) as info:
            PolicyModule(name="p", model=str(folder), **extra)
        msg = str(info.value)
        assert (f"policy 'p': model={str(folder)!r} holds no tokenizer files: a gpt2 model's tokenizer is "
                "tokenizer.json, or vocab.json + merges.txt, and the folder has neither") in msg, msg
        assert "tok.save_pretrained" in msg and "tokenizer: <" in msg
        assert "pad token" not in msg and "max_prompt_length" not in msg
    policy = PolicyModule(name="p", model=str(folder), tokenizer=str(tiny_lm_folder))  # its tokenizer given apart
    assert policy.tokenizer is not None


def test_the_tokenizer_files_a_folder_needs_follow_its_config(tmp_path):
    from mrl_lightning.model.source import tokenizer_files_problem

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert tokenizer_files_problem(tmp_path) == ("a llama model's tokenizer is tokenizer.json, or tokenizer.model "
                                                 "(SentencePiece), and the folder has neither")
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    assert tokenizer_files_problem(tmp_path) is None


CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _chat_tokenizer(tiny_lm_folder, template=CHAT):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_lm_folder))
    tok.chat_template = template
    return tok


def test_chat_template_tokenizer_gives_one_bos_and_keeps_it_when_truncating(tiny_lm_folder):
    tok = _chat_tokenizer(tiny_lm_folder)
    text = render_chat_prompt(tok, "What is 7 - 5?")
    assert text.startswith(tok.bos_token) and text.endswith("<|assistant|>")
    lengths = []
    (full,) = encode_rendered(tok, [text], max_len=1000)
    (ids,) = encode_rendered(tok, [text], max_len=8, full_lengths=lengths)
    assert full[0] == tok.bos_token_id and full.count(tok.bos_token_id) == 1  # template and tokenizer: one BOS
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1 and ids[1:] == full[-7:]
    assert lengths == [len(full)]


def test_template_rendering_two_questions_alike_is_a_config_error(tiny_lm_folder):
    with pytest.raises(ConfigError) as info:
        PolicyModule(name="p", model=str(tiny_lm_folder), max_prompt_length=6)
    msg = str(info.value)
    assert "max_prompt_length=6 cuts every prompt to its last 6 tokens, 'nswer:'" in msg
    assert "Raise max_prompt_length" in msg


def test_chat_template_that_drops_the_question_is_a_config_error(tiny_lm_folder, tmp_path):
    drops_user = "{{ bos_token }}<|system|>Be brief.\n{% if add_generation_prompt %}<|assistant|>{% endif %}"
    folder = tmp_path / "chat_tok"
    _chat_tokenizer(tiny_lm_folder, drops_user).save_pretrained(str(folder))
    with pytest.raises(ConfigError, match="chat template .*renders the same prompt .*never reaches the model"):
        PolicyModule(name="p", model=str(tiny_lm_folder), tokenizer=str(folder), chat_template=True)
    PolicyModule(name="p", model=str(tiny_lm_folder), tokenizer=str(folder))  # the plain template is fine
