"""HF generate engine: completion mask through the real EOS when pad == eos, finish reasons.

docs/grpo.md, "Sampling": the mask is built from the first EOS position, never
from ``!= pad``, because with pad == eos (every tokenizer of the embedded default) a
``!= pad`` mask would drop the EOS the policy actually sampled.
"""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.rollout import HFGenerateEngine, completion_mask_from_eos, left_pad

PAD = EOS = 2
PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "ab"]


def test_mask_keeps_the_first_eos_when_pad_equals_eos():
    ids = torch.tensor([
        [5, 7, 2, 2, 2],  # EOS at 2, then pad (== EOS): mask through position 2
        [2, 2, 2, 2, 2],  # EOS first: only that token counts
        [5, 6, 7, 8, 9],  # no EOS: everything counts, truncated
        [5, 2, 6, 2, 2],  # two EOS: the first one ends the completion
    ])
    mask, has_eos = completion_mask_from_eos(ids, EOS)
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, False, False, False, False],
        [True, True, True, True, True],
        [True, True, False, False, False],
    ]
    assert has_eos.tolist() == [True, True, False, True]
    # The naive mask would lose the sampled EOS of row 0 (and all of row 1).
    assert not (ids != PAD)[0, 2] and mask[0, 2]


def test_mask_accepts_several_eos_ids():
    ids = torch.tensor([[5, 9, 7, 2], [5, 6, 7, 8]])
    mask, has_eos = completion_mask_from_eos(ids, [2, 9])
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert has_eos.tolist() == [True, False]


def test_left_pad_by_hand():
    ids, mask = left_pad([[1, 2, 3], [4], []], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]]
    assert mask.tolist() == [[True, True, True], [False, False, True], [False, False, False]]
    assert ids.dtype == torch.long and mask.dtype == torch.bool


@pytest.fixture(scope="module")
def rollout(tiny_lm):
    model, tok = tiny_lm
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    model.train()
    torch.manual_seed(1)
    out = HFGenerateEngine().generate(model, tok, ids, num_generations=4, max_completion_length=6, temperature=0.7)
    return out, ids, tok, model


def test_tokenizer_under_test_has_pad_equal_to_eos(tiny_lm):
    _, tok = tiny_lm
    assert tok.pad_token_id == tok.eos_token_id


def test_engine_keeps_real_eos_in_mask_and_reports_finish_reason(rollout):
    out, _, tok, _ = rollout
    eos = tok.eos_token_id
    assert out.completion_ids.shape == (12, 6) and out.completion_mask.shape == (12, 6)
    reasons = set(out.finish_reasons)
    assert reasons == {"stop", "length"}, "the fixture model should produce both kinds with this seed"
    for row, mask, reason in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), out.finish_reasons):
        n = sum(mask)
        assert mask == [True] * n + [False] * (6 - n)  # a prefix
        if reason == "stop":
            assert row[n - 1] == eos  # the sampled EOS is counted ...
            assert eos not in row[: n - 1]  # ... and it is the first one
            assert row[n:] == [tok.pad_token_id] * (6 - n)
        else:
            assert n == 6 and eos not in row
    assert out.truncated.tolist() == [r == "length" for r in out.finish_reasons]


def test_old_logprobs_are_counted_at_eos_and_zero_after(rollout):
    out, _, _, _ = rollout
    m = out.completion_mask
    assert (out.old_logprobs[m] < 0).all()  # includes the EOS positions
    assert (out.old_logprobs[~m] == 0).all()
    eos_rows = [i for i, r in enumerate(out.finish_reasons) if r == "stop"]
    last = m[eos_rows].sum(1) - 1
    assert (out.old_logprobs[eos_rows, last] < 0).all()


def _char_level_bytes(tok, ids: list[int]) -> bytes:
    """Bytes of char-level tokens by hand: ``<0xHH>`` pieces are one byte, the rest their UTF-8."""
    pieces = tok.convert_ids_to_tokens(ids)
    return b"".join(bytes.fromhex(p[3:5]) if p.startswith("<0x") and len(p) == 6 else p.encode() for p in pieces)


def test_texts_exclude_eos_and_match_counted_tokens(rollout):
    out, _, tok, _ = rollout
    for row, mask, text, reason in zip(out.completion_ids, out.completion_mask, out.completion_texts,
                                       out.finish_reasons):
        assert "</s>" not in text
        counted = row[mask].tolist()
        if reason == "stop":
            counted = counted[:-1]  # the EOS adds no text
        assert text == _char_level_bytes(tok, counted).decode("utf-8", errors="replace")


def test_rows_are_prompt_major_and_left_padded(rollout):
    out, ids, _, _ = rollout
    lengths = [len(x) for x in ids]
    assert len(set(lengths)) == 3  # prompts of different lengths
    assert out.prompt_mask.sum(1).tolist() == [n for n in lengths for _ in range(4)]
    assert out.prompt_mask[:, -1].all()  # left padding: the last column is always real
    for b, prompt in enumerate(ids):
        for g in range(4):
            row = b * 4 + g
            assert out.prompt_ids[row][out.prompt_mask[row]].tolist() == prompt


def test_engine_restores_training_mode(rollout):
    _, _, _, model = rollout
    assert model.training  # was .train() before generate, sampled in eval, restored after


def test_greedy_decoding_repeats_the_same_completion(tiny_lm):
    model, tok = tiny_lm
    out = HFGenerateEngine().generate(model, tok, [tok(PROMPTS[0])["input_ids"]], num_generations=3,
                                      max_completion_length=5, do_sample=False)
    assert (out.completion_ids == out.completion_ids[0]).all()
    assert out.completion_texts[0] == out.completion_texts[1] == out.completion_texts[2]


def test_bad_arguments_raise(tiny_lm):
    model, tok = tiny_lm
    with pytest.raises(ValueError, match="empty"):
        HFGenerateEngine().generate(model, tok, [], num_generations=2, max_completion_length=2)
    with pytest.raises(ValueError, match="temperature=0"):
        HFGenerateEngine().generate(model, tok, [[5]], num_generations=2, max_completion_length=2, temperature=0)
