"""Residual metrics (hand-worked) and the ``mrl thl`` command (docs/thl.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mrl_lightning.thl import (
    MappedTrace,
    Retokenized,
    align_bytes,
    map_logprobs,
    residual_metrics,
)
from mrl_lightning.thl.cli import main

REQUIRED = ("round_trip_failures", "boundary_agreement", "tokens_per_chunk", "logprob_mass_moved", "max_conservation_error")


def _trace(src, tgt, lps, ok=True):
    al = align_bytes(src, tgt)
    mapped = map_logprobs(lps, al)
    retok = Retokenized([], list(range(len(tgt))), [], False, ok)
    return MappedTrace(retok, al, lps, mapped, True, abs(sum(mapped) - sum(lps)))


def test_residual_metrics_hand_worked():
    # "ab|c|de|!" vs "a|bc|d|e|!": chunks [0,3) [3,5) [5,6); the first two are split over 2 target tokens
    one = _trace([b"ab", b"c", b"de", b"!"], [b"a", b"bc", b"d", b"e", b"!"], [-1.0, -2.0, -4.0, -3.0])
    # identical segmentations: nothing moved, every boundary shared
    two = _trace([b"x", b"y"], [b"x", b"y"], [-0.5, -0.5])
    m = residual_metrics([one, two])
    assert m["thl/num_sequences"] == 2.0
    assert m["thl/round_trip_failures"] == 0.0
    assert m["thl/boundary_agreement"] == pytest.approx((2 + 1) / (4 + 1))
    assert m["thl/tokens_per_chunk"] == pytest.approx((4 + 5 + 2 + 2) / (2 * (3 + 2)))
    assert m["thl/source_tokens_per_chunk"] == pytest.approx(6 / 5)
    assert m["thl/logprob_mass_moved"] == pytest.approx(7.0 / 11.0)
    assert m["thl/logprob_mass_moved_nats"] == pytest.approx(7.0 / 2)
    assert m["thl/max_conservation_error"] < 1e-12


def test_residual_counts_round_trip_failures_and_empty_batch():
    bad = _trace([b"abc"], [b"abd"], [-1.0])
    assert not bad.round_trip_ok
    m = residual_metrics([bad], prefix="")
    assert m["round_trip_failures"] == 1.0 and m["max_conservation_error"] < 1e-12
    assert residual_metrics([]) == {"thl/num_sequences": 0.0}


@pytest.fixture(scope="module")
def no_fallback_char_dir(tmp_path_factory):
    """A character-level tokenizer with no byte fallback: unseen characters become <unk>."""
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("abc ")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    path = tmp_path_factory.mktemp("nofallback")
    hf.save_pretrained(str(path))
    return path


def test_cli_prints_required_metrics_and_exits_zero(toks, tokenizer_dirs, thl_cache, capsys):
    rc = main(["--source", "mistral-v1", "--target", str(tokenizer_dirs / "byte-bpe"), "--cache-dir", str(thl_cache)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in REQUIRED:
        assert key in report
    assert report["round_trip_failures"] == 0 and report["num_texts"] > 10
    assert report["max_conservation_error"] < 1e-5
    assert 0.0 < report["boundary_agreement"] <= 1.0 and report["tokens_per_chunk"] >= 1.0


def test_cli_reads_text_file_and_exits_nonzero_on_round_trip_failure(tokenizer_dirs, no_fallback_char_dir, tmp_path, capsys):
    text_file = tmp_path / "texts.jsonl"
    text_file.write_text("\n".join(json.dumps(t) for t in ["abc", " cab", "xyz \u4e2d"]) + "\n")
    rc = main(["--source", str(tokenizer_dirs / "byte-bpe"), "--target", str(no_fallback_char_dir), "--text-file", str(text_file)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert report["num_texts"] == 3 and report["round_trip_failures"] == 1
    assert report["failing_texts"] == ["xyz \u4e2d"]
    assert report["max_conservation_error"] < 1e-5  # mass is kept even where text is not


def test_cli_reports_bad_input_with_status_two(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"not": "a string"}\n')
    assert main(["--source", "mistral-v1", "--target", "tekken", "--text-file", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('"ok"\n')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--source", str(tmp_path / "no-such-folder"), "--target", "tekken", "--text-file", str(good)]) == 2
    err = capsys.readouterr().err
    assert "no-such-folder" in err and "mistral-v1" in err  # names the value and the valid choices


def test_cli_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "mrl_lightning.thl.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--text-file" in out.stdout
