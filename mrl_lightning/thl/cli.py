"""``mrl thl``: measure THL between any two tokenizers (docs/thl.md).

    mrl thl --source mistral-v1 --target tekken [--text-file FILE] [--cache-dir DIR]

Each text is encoded as a completion by the source tokenizer, given a synthetic
per-token log-prob trace (seeded, uniform in [-8, -0.001] nats), retokenized for the
target, aligned and mapped (:func:`~mrl_lightning.thl.trace.transfer_trace`). Prints
one JSON object: the residual metrics of :mod:`.residual` over all texts, plus
``native_round_trip_failures`` (texts the tokenizers' own
``decode(encode(x), skip_special_tokens=True)`` does not give back; informational) and
up to five failing texts. Exit status: 0 if every text round-trips through THL, 1 if
any fails, 2 on a usage or loading error.

FILE holds one JSON string per line (blank lines skipped).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Sequence

from mrl_lightning.thl.loader import load_tokenizer
from mrl_lightning.thl.residual import residual_metrics
from mrl_lightning.thl.retokenize import encode_completion
from mrl_lightning.thl.trace import transfer_trace

SAMPLE_TEXTS = (
    "The answer is 42.",
    " 68",
    "  two leading spaces and trailing  ",
    "line one\nline two\n\n\tindented with a tab",
    "12345 + 67890 = 80235",
    "3.14159 and 1,000,000 and -7",
    "\u4e2d\u6587\u6d4b\u8bd5\uff1a\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001F600 and family \U0001F468\u200d\U0001F469\u200d\U0001F467",
    "flag \U0001F1EB\U0001F1F7 and skin tone \U0001F44D\U0001F3FD",
    "combining: e\u0301 a\u0308 n\u0303 (NFD) vs \u00e9 \u00e4 \u00f1 (NFC)",
    "looks special: </s> <s> <unk> [INST] <0x41> <|endoftext|>",
    "def f(x):\n    return x ** 2  # square\n",
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439\u0442\u0435, \u043c\u0438\u0440!",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "<answer>17</answer>",
    "a\u2581b uses the SentencePiece marker as a character",
    "",
    " ",
    "\r\n windows line end",
    "cut inside a character \U0001F600"[:-1] + "\ufffd",
    "math: \u222b x\u00b2 dx = x\u00b3/3 + C, \u03b1 \u2264 \u03b2",
)


def _read_texts(path: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"--text-file {path}, line {lineno}: not JSON ({err.msg}); write one JSON string per line."
                ) from None
            if not isinstance(value, str):
                raise ValueError(
                    f"--text-file {path}, line {lineno}: got {type(value).__name__}; each line must be a JSON string."
                )
            texts.append(value)
    if not texts:
        raise ValueError(f"--text-file {path} holds no texts; write one JSON string per line.")
    return texts


def _native_ok(tokenizer, text: str) -> bool:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return tokenizer.decode(ids, skip_special_tokens=True) == text


def build_parser() -> argparse.ArgumentParser:
    """The ``mrl thl`` argument parser."""
    parser = argparse.ArgumentParser(prog="mrl thl", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument(
        "--source", required=True, help="source tokenizer: mistral-v1, mistral-v3, tekken, a folder or a hub id"
    )
    parser.add_argument("--target", required=True, help="target tokenizer (same forms as --source)")
    parser.add_argument(
        "--text-file", default=None, help="file with one JSON string per line (default: built-in sample)"
    )
    parser.add_argument("--cache-dir", default=None, help="cache for converted mistral-common tokenizers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic log-prob trace")
    return parser


def run(source: str, target: str, texts: Sequence[str], cache_dir: str | None = None, seed: int = 0,
        hub_kwargs=None) -> dict:
    """Score ``texts`` between two tokenizers; returns the JSON report as a dict.

    Args:
        hub_kwargs: ``(spec, option) -> from_pretrained kwargs`` for a spec that is a hub id (``mrl``
            passes the hub's fast offline check, :func:`mrl_lightning.model.hub.hub_load_kwargs`); None = none.

    Raises:
        ValueError: If a tokenizer spec cannot be loaded (or its hub id cannot be reached).
        TypeError: If a tokenizer is not a fast tokenizer.
    """
    def kwargs(option: str):
        return None if hub_kwargs is None else (lambda spec: hub_kwargs(spec, option))

    src_tok = load_tokenizer(source, cache_dir=cache_dir, hub_kwargs=kwargs("--source"))
    tgt_tok = load_tokenizer(target, cache_dir=cache_dir, hub_kwargs=kwargs("--target"))
    rng = random.Random(seed)
    traces, failing, native = [], [], 0
    for text in texts:
        src = encode_completion(src_tok, text)
        logprobs = [-rng.uniform(0.001, 8.0) for _ in src.completion_ids]
        trace = transfer_trace(src_tok, src.completion_ids, logprobs, tgt_tok, "", text)
        trace.source_round_trip_ok = trace.source_round_trip_ok and src.round_trip_ok
        traces.append(trace)
        if not trace.round_trip_ok and len(failing) < 5:
            failing.append(text)
        native += not (_native_ok(src_tok, text) and _native_ok(tgt_tok, text))
    report = {"source": source, "target": target, "num_texts": len(texts)}
    for key, value in residual_metrics(traces, prefix="").items():
        report[key] = int(value) if key in ("num_sequences", "round_trip_failures") else value
    report["native_round_trip_failures"] = native
    report["failing_texts"] = failing
    return report


def main(argv: list[str] | None = None, hub_kwargs=None) -> int:
    """Entry point of ``mrl thl``; returns the exit status (0 ok, 1 round-trip failure, 2 error).

    ``hub_kwargs``: as :func:`run`'s.
    """
    args = build_parser().parse_args(argv)
    try:
        texts = _read_texts(args.text_file) if args.text_file else list(SAMPLE_TEXTS)
        report = run(args.source, args.target, texts, cache_dir=args.cache_dir, seed=args.seed,
                     hub_kwargs=hub_kwargs)
    except (OSError, ValueError, TypeError) as err:
        print(f"mrl thl: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, ensure_ascii=False))
    return 1 if report.get("round_trip_failures", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
