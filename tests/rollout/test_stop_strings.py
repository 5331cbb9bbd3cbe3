"""Stop strings (docs/rollout.md, "Stop strings"): cut exactly as vLLM 0.32 cuts them, on both engines.

The rules (``mrl_lightning/rollout/stops.py``, read from ``vllm/v1/engine/detokenizer.py``): a
completion ends at the token whose text completes a stop string (the one ending first wins,
ties by list order), finish ``stop``, ``stop_reason`` the string, also on the last token the
length limit allows; the text is cut before the string (after it with
``include_stop_str_in_output``); the token ids, mask and log-probs keep every token through that
one, also when it holds text past the stop string.

Two tokenizers: the rollout tests' character-level one (every byte a token) and a byte-level BPE
whose vocabulary has ``"12\\nQ"`` as one token (``tiny_models.build_tiny_crossing_gpt2``), the case
where a stop string ``"\\n"`` ends inside a token that goes on past it.
"""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.policy import PolicyModule
from mrl_lightning.rollout.hf_generate import HFGenerateEngine
from mrl_lightning.rollout.stops import check_stop_strings, scan_completion
from mrl_lightning.rollout.vllm_engine import ColocatedVLLM, ServerVLLM, VLLMEngine
from mrl_lightning.thl import decode_completion
from tiny_models import CROSSING, build_tiny_crossing_gpt2

G, L = 6, 12
PROMPTS = [[5, 6, 7], [8, 9]]


# ------------------------------------------------------------------ the rule itself, worked by hand
@pytest.mark.parametrize("text, new, stop, include, expected", [
    ("A12\nQ", 4, ["\n"], False, ("\n", 3)),          # cut before the newline: "A12"
    ("A12\nQ", 4, ["\n"], True, ("\n", 4)),           # kept: "A12\n", the "Q" after it still cut
    ("A12\n", 1, ["\n"], True, ("\n", -1)),           # kept and at the end: nothing to cut
    ("xABC", 3, ["BC", "AB"], False, ("AB", 1)),      # "AB" ends first (at 3) although listed second
    ("xAB", 2, ["B", "AB"], False, ("B", 2)),         # both end at 3: list order decides
    ("a\nb", 1, ["\n"], False, None),                 # a match wholly in the old text is not searched again
    ("A\nQuestion:", 5, ["Question:"], False, ("Question:", 2)),  # a stop string spanning old and new text
    ("abc", 0, ["b"], False, None),                   # no new text, nothing checked
])
def test_check_stop_strings_follows_vllm(text, new, stop, include, expected):
    assert check_stop_strings(text, new, stop, include) == expected


@pytest.fixture(scope="module")
def crossing(tmp_path_factory):
    """(model, tokenizer, the "12\\nQ" token id, folder) of :func:`tiny_models.build_tiny_crossing_gpt2`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_crossing_gpt2(tmp_path_factory.mktemp("crossing"))
    tok = AutoTokenizer.from_pretrained(str(folder))
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), tok, tok.convert_tokens_to_ids(CROSSING), folder


@pytest.fixture(scope="module")
def bpe(crossing):
    return crossing[1]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_token_holding_the_stop_string_in_its_middle_is_kept_and_its_text_cut(bpe):
    tok = bpe
    ids = _ids(tok, "A12\nQx")
    assert tok.convert_ids_to_tokens(ids) == ["A", "12ĊQ", "x"]
    scan = scan_completion(tok, ids, [tok.eos_token_id], ["\n"])
    assert (scan.length, scan.stopped, scan.stop_reason, scan.text) == (2, True, "\n", "A12")
    kept = scan_completion(tok, ids, [tok.eos_token_id], ["\n"], include_stop_str_in_output=True)
    assert (kept.length, kept.text) == (2, "A12\n")  # same tokens; the "Q" the token holds is cut either way


def test_a_stop_token_before_any_stop_string_ends_it_and_gives_no_cut_text(bpe):
    tok = bpe
    ids = _ids(tok, "A") + [tok.eos_token_id] + _ids(tok, "12\nQ")
    scan = scan_completion(tok, ids, [tok.eos_token_id], ["\n"])
    assert (scan.length, scan.stopped, scan.stop_reason, scan.text) == (2, True, tok.eos_token_id, None)
    assert scan_completion(tok, _ids(tok, "AB"), [tok.eos_token_id], ["\n"]).stopped is False


def test_a_stop_string_split_inside_a_character_matches_once_its_last_byte_arrives(bpe):
    tok = bpe
    ids = _ids(tok, "aé!")  # é is two byte tokens here
    assert len(ids) == 4
    scan = scan_completion(tok, ids, [tok.eos_token_id], ["é"])
    assert (scan.length, scan.text) == (3, "a")


# ------------------------------------------------------------------ the Hugging Face engine, real tiny models
def _generate(engine, model, tok, **kwargs):
    args = dict(num_generations=G, max_completion_length=L, temperature=1.0, prompt_seeds=[3, 4],
                stop_token_ids=[tok.eos_token_id])
    args.update(kwargs)
    return engine.generate(model, tok, PROMPTS, **args)


def _first_stop_token(tok, ids, stop):
    for k in range(len(ids)):
        text = decode_completion(tok, ids[:k + 1], errors="replace")
        if stop in text:
            return k, text[:text.index(stop)]
    return None, None


def test_hf_engine_cuts_each_row_where_its_text_first_holds_the_stop_and_keeps_the_prefix_exact(tiny_lm):
    """The same seeds with and without the stop ("4": the tiny model writes it often): the cut rows are the
    uncut ones' prefixes, token for token, log-prob for log-prob, and their text is the uncut text before it."""
    model, tok = tiny_lm
    free = _generate(HFGenerateEngine(), model, tok)
    cut = _generate(HFGenerateEngine(), model, tok, stop=["4"])
    stopped_rows = 0
    for row in range(2 * G):
        ids = free.completion_ids[row][free.completion_mask[row]].tolist()
        k, before = _first_stop_token(tok, ids, "4")
        if k is None or tok.eos_token_id in ids[:k]:
            assert cut.completion_ids[row][cut.completion_mask[row]].tolist() == ids
            assert cut.finish_reasons[row] == free.finish_reasons[row]
            continue
        stopped_rows += 1
        n = int(cut.completion_mask[row].sum())
        assert n == k + 1 and cut.completion_ids[row, :n].tolist() == ids[:k + 1]
        assert torch.allclose(cut.old_logprobs[row, :n], free.old_logprobs[row, :n], atol=1e-6)
        assert cut.old_logprobs[row, n:].abs().sum() == 0 and (cut.completion_ids[row, n:] == tok.pad_token_id).all()
        assert (cut.finish_reasons[row], cut.stop_reasons[row], cut.completion_texts[row]) == ("stop", "4", before)
    assert stopped_rows >= 2, "the fixture should write the stop string in some rows within L tokens"


def _check_crossing_rows(out, tok, token):
    crossed = 0
    for row in range(out.completion_ids.shape[0]):
        ids = out.completion_ids[row][out.completion_mask[row]].tolist()
        if token in ids:
            crossed += 1
            assert ids[-1] == token and token not in ids[:-1]  # kept, and nothing after it
            assert out.finish_reasons[row] == "stop" and out.stop_reasons[row] == "\n"
            assert out.completion_texts[row] == tok.decode(ids).split("\n")[0]  # ends with "12", no "Q"
            assert out.completion_texts[row].endswith("12")
            assert (out.old_logprobs[row, :len(ids)] != 0).all()
    assert crossed >= 3


def test_hf_engine_keeps_the_token_that_crosses_the_stop_and_cuts_its_text(crossing):
    model, tok, token, _ = crossing
    out = _generate(HFGenerateEngine(), model, tok, stop=["\n"])
    _check_crossing_rows(out, tok, token)


def test_the_last_token_the_length_limit_allows_still_ends_with_finish_stop_when_it_completes_a_stop(crossing):
    """Rerun with the limit at the length of a row that stopped at the crossing token: that row's last allowed
    token completes the stop, so its finish is "stop", not "length" (vLLM's output processor overrides it)."""
    model, tok, token, _ = crossing
    full = _generate(HFGenerateEngine(), model, tok, stop=["\n"])
    lengths = full.completion_mask.sum(dim=1).tolist()
    limit = min(n for n, r in zip(lengths, full.stop_reasons) if r == "\n")
    short = _generate(HFGenerateEngine(), model, tok, stop=["\n"], max_completion_length=limit)
    at_limit = [r for r in range(2 * G) if full.stop_reasons[r] == "\n" and lengths[r] == limit]
    assert at_limit and all((short.finish_reasons[r], short.stop_reasons[r]) == ("stop", "\n") for r in at_limit)
    longer = [r for r in range(2 * G) if lengths[r] > limit]
    assert all(short.finish_reasons[r] == "length" for r in longer)


# ------------------------------------------------------------------ vLLM: the double, colocated and server
def _colocated(folder):
    from vllm_double import FakeLLM, FakeSamplingParams

    llm = FakeLLM(str(folder), logprobs_mode="processed_logprobs")
    return VLLMEngine(ColocatedVLLM(llm, FakeSamplingParams)), llm


def test_vllm_engine_cuts_as_vllm_does_and_the_server_mode_replay_agrees(crossing):
    """Colocated: the engine's ids, finish and text equal what (the double of) vLLM returned, its text
    included; server mode, whose reply has neither text nor finish reason, gives the same batch."""
    from vllm_double import FakeLLM, FakeVLLMClient

    model, tok, token, folder = crossing
    engine, llm = _colocated(folder)
    out = _generate(engine, model, tok, stop=["\n"])
    _check_crossing_rows(out, tok, token)
    calls = llm.calls[-1]
    assert all(p.stop == ["\n"] and p.include_stop_str_in_output is False for p in calls)
    raw = [c for request in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], calls, use_tqdm=False)
           for c in sorted(request.outputs, key=lambda c: c.index)]
    for row, c in enumerate(raw):
        assert out.completion_ids[row][out.completion_mask[row]].tolist() == list(c.token_ids)
        assert (out.finish_reasons[row], out.completion_texts[row]) == (c.finish_reason, c.text)
        if isinstance(c.stop_reason, str):  # vLLM gives EOS no stop_reason; the batch names its id
            assert out.stop_reasons[row] == c.stop_reason
    server = VLLMEngine(ServerVLLM(FakeVLLMClient(FakeLLM(str(folder))))).generate(
        model, tok, PROMPTS, num_generations=G, max_completion_length=L, temperature=1.0, prompt_seeds=[3, 4],
        stop_token_ids=[tok.eos_token_id], stop=["\n"])
    assert torch.equal(server.completion_ids, out.completion_ids)
    assert torch.equal(server.completion_mask, out.completion_mask)
    assert (server.finish_reasons, server.completion_texts) == (out.finish_reasons, out.completion_texts)


def test_vllm_engine_with_the_stop_kept_in_the_text(crossing):
    model, tok, token, folder = crossing
    engine, llm = _colocated(folder)
    out = _generate(engine, model, tok, stop=["\n"], include_stop_str_in_output=True)
    rows = [r for r in range(2 * G) if out.stop_reasons[r] == "\n"]
    assert rows and all(out.completion_texts[r].endswith("12\n") for r in rows)


def test_vllm_double_refuses_an_empty_stop_string_as_vllm_does():
    from vllm_double import FakeSamplingParams, VLLMValidationError

    with pytest.raises(VLLMValidationError, match="empty string"):
        FakeSamplingParams(stop=[""])


# ------------------------------------------------------------------ the policy option
def test_policy_stop_is_a_list_and_an_empty_string_is_a_config_error(tiny_lm_dir):
    policy = PolicyModule(name="p", model=str(tiny_lm_dir), stop="\n")
    assert policy.stop == ["\n"] and policy.stop_kwargs == {"stop": ["\n"], "include_stop_str_in_output": False}
    assert PolicyModule(name="q", model=str(tiny_lm_dir)).stop_kwargs == {}
    with pytest.raises(ConfigError, match=r"stop=\[''\] must be a list of non-empty strings"):
        PolicyModule(name="r", model=str(tiny_lm_dir), stop=[""])
