"""Benchmark: THL byte-chunk alignment vs a dynamic-programming token aligner (docs/thl.md).

Not a test. 1,000 synthetic completions of about 256 Mistral-v1 (SentencePiece) tokens
each are mapped onto Tekken: per-token sampling log-probs (synthetic, nats) go from
v1 tokens to Tekken tokens.

Rows of the printed table (throughput in source tokens per second, one process, one thread):

- ``THL full``: retokenize the text for Tekken + recover bytes on both sides + chunk
  alignment + log-prob mapping (what the training loop pays per peer completion).
- ``THL align+map``: only :func:`align_bytes` + :func:`map_logprobs` on ready token bytes.
- ``DP align+map``: the baseline, a Levenshtein alignment of the two token-string
  sequences (O(Ls * Lt) cells; match cost 0 for equal strings, 1 otherwise), then each
  target token takes the log-prob of the source token it was matched to (0 if none), as
  token-level cross-tokenizer aligners do.

Quality columns: mean and max ``|sum(mapped) - sum(source)|`` per sequence (nats), and
the share of sequences where the target tokens spell the text exactly.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/thl_align.py [--n 1000] [--tokens 256] [--dp-n 1000]
"""

from __future__ import annotations

import argparse
import math
import random
import time

from mrl_lightning.thl import align_bytes, encode_completion, load_tokenizer, map_logprobs, token_bytes

WORDS = (
    "the answer is of and to in that we add subtract carry ones tens hundreds first then so therefore "
    "because total sum difference product quotient remainder step check result equation value number "
    "question Let's think carefully about this problem each term both sides"
).split()
EXTRA = ("\u4e2d\u6587", "caf\u00e9", "\U0001F600", "e\u0301", "x\u00b2", "\u03b1", "<answer>", "</answer>", "\n", "\n\n", "  ")


def make_text(rng: random.Random, tokenizer, target_tokens: int) -> str:
    """A synthetic reasoning-like completion of about ``target_tokens`` tokenizer tokens."""
    parts: list[str] = []
    while True:
        roll = rng.random()
        if roll < 0.70:
            parts.append(" " + rng.choice(WORDS))
        elif roll < 0.85:
            parts.append(" " + str(rng.randint(0, 10 ** rng.randint(1, 6))))
        elif roll < 0.93:
            parts.append(rng.choice((",", ".", ":", " =", " +", " -", " *", "?")))
        else:
            parts.append(rng.choice(EXTRA))
        if len(parts) % 4 == 0 and len(encode_completion(tokenizer, "".join(parts)).completion_ids) >= target_tokens:
            return "".join(parts)


def dp_align(src: list[str], tgt: list[str]) -> list[tuple[int, int]]:
    """Levenshtein alignment of two token-string sequences; returns matched (i, j) pairs."""
    n, m = len(src), len(tgt)
    prev = list(range(m + 1))
    back = [bytearray(m + 1) for _ in range(n + 1)]  # 0 diag, 1 up (delete src), 2 left (insert tgt)
    for j in range(1, m + 1):
        back[0][j] = 2
    for i in range(1, n + 1):
        cur = [i] + [0] * m
        row, s = back[i], src[i - 1]
        row[0] = 1
        for j in range(1, m + 1):
            diag = prev[j - 1] + (s != tgt[j - 1])
            up, left = prev[j] + 1, cur[j - 1] + 1
            if diag <= up and diag <= left:
                cur[j] = diag
            elif up <= left:
                cur[j], row[j] = up, 1
            else:
                cur[j], row[j] = left, 2
        prev = cur
    pairs, i, j = [], n, m
    while i > 0 or j > 0:
        move = back[i][j]
        if move == 0:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def dp_map(lps: list[float], n_target: int, pairs: list[tuple[int, int]]) -> list[float]:
    out = [0.0] * n_target
    for i, j in pairs:
        out[j] = lps[i]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="number of completions")
    parser.add_argument("--tokens", type=int, default=256, help="approximate v1 tokens per completion")
    parser.add_argument("--dp-n", type=int, default=1000, help="completions run through the DP baseline")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    v1, tek = load_tokenizer("mistral-v1"), load_tokenizer("tekken")
    rng = random.Random(args.seed)
    texts = [make_text(rng, v1, args.tokens) for _ in range(args.n)]
    sources = [encode_completion(v1, t).completion_ids for t in texts]
    lps = [[-rng.uniform(0.001, 8.0) for _ in ids] for ids in sources]
    encode_completion(tek, "warm up")
    n_src = sum(map(len, sources))
    print(f"setup {time.perf_counter() - t0:.1f} s; {args.n} completions, {n_src} v1 tokens "
          f"(mean {n_src / args.n:.0f}), {sum(map(len, texts))} characters")

    rows = []
    start = time.perf_counter()
    errs, exact, tgt_ids = [], 0, []
    for text, ids, lp in zip(texts, sources, lps):
        tgt = encode_completion(tek, text).completion_ids
        src_p, tgt_p = token_bytes(v1, ids), token_bytes(tek, tgt)
        mapped = map_logprobs(lp, align_bytes(src_p, tgt_p))
        errs.append(abs(math.fsum(mapped) - math.fsum(lp)))
        exact += b"".join(tgt_p) == text.encode()
        tgt_ids.append(tgt)
    rows.append(("THL full (retokenize+align+map)", args.n, n_src, time.perf_counter() - start, errs))

    src_pieces = [token_bytes(v1, ids) for ids in sources]
    tgt_pieces = [token_bytes(tek, ids) for ids in tgt_ids]
    start = time.perf_counter()
    errs = [abs(math.fsum(map_logprobs(lp, align_bytes(a, b))) - math.fsum(lp)) for a, b, lp in zip(src_pieces, tgt_pieces, lps)]
    rows.append(("THL align+map", args.n, n_src, time.perf_counter() - start, errs))

    k = min(args.dp_n, args.n)
    src_str = [[p.decode("utf-8", "replace").strip() for p in ps] for ps in src_pieces[:k]]
    tgt_str = [[p.decode("utf-8", "replace").strip() for p in ps] for ps in tgt_pieces[:k]]
    start = time.perf_counter()
    errs = []
    for a, b, lp in zip(src_str, tgt_str, lps[:k]):
        mapped = dp_map(lp, len(b), dp_align(a, b))
        errs.append(abs(math.fsum(mapped) - math.fsum(lp)))
    rows.append(("DP edit-distance align+map", k, sum(map(len, sources[:k])), time.perf_counter() - start, errs))

    print(f"\n{'method':34s} {'seqs':>5s} {'src tokens':>10s} {'time s':>8s} {'tokens/s':>11s} {'mean |dsum| nats':>17s} {'max |dsum|':>11s}")
    for name, n, toks, secs, e in rows:
        print(f"{name:34s} {n:5d} {toks:10d} {secs:8.2f} {toks / secs:11,.0f} {sum(e) / len(e):17.3g} {max(e):11.3g}")
    print(f"\nTekken tokens spell the text exactly: {exact}/{args.n}; "
          f"mean Tekken tokens per completion {sum(map(len, tgt_ids)) / args.n:.0f}")


if __name__ == "__main__":
    main()
