"""Benchmark: THL byte-chunk alignment vs TRL's GOLD byte-offset grouping and a DP aligner (docs/thl.md).

Not a test. ``--n`` synthetic completions of about 256 Mistral-v1 tokens each (reasoning-like
words and numbers, with CJK, an emoji, accents, superscripts, newlines and double spaces
mixed in) are mapped across two tokenizer pairs, the same texts for both:

- ``v1->tekken``: Mistral v1 (SentencePiece, ``▁`` word marks, ``<0xHH>`` byte fallback) to
  Tekken (byte-level BPE), both from the mistral-common wheel via :func:`load_tokenizer`;
- ``bpe->tekken``: a byte-level BPE trained here with
  :func:`mrl_lightning.recipes.tokenizers.train_byte_level_bpe` (asked for 1,000 tokens, on
  200 other completions of the same generator; the setup line prints the size it reaches)
  to Tekken: both sides byte-level, the case GOLD is written for.

GOLD cannot take Mistral v1 as its teacher (nor as an off-policy student, whose offsets
come from the same encoder): ``encode_with_byte_offsets`` accepts only byte-level
tokenizers; the last line printed shows its error.

The source side is the producer (its ids are what it sampled: THL's ``encode_completion``
of the text); the target is the receiver (GOLD: the teacher). Per-token sampling log-probs
(synthetic, nats) go from source tokens to target tokens.

Rows of the printed table (throughput in source tokens per second, one process, one thread;
``TOKENIZERS_PARALLELISM=false`` keeps the tokenizers' batch encoder on one thread too):

- ``THL full``: retokenize the text for the target + recover bytes on both sides + chunk
  alignment + log-prob mapping (what the training loop pays per peer completion).
- ``THL align+map``: only :func:`align_bytes` + :func:`map_logprobs` on ready token bytes.
- ``THL align``: only :func:`align_bytes` (chunks and in-chunk weights; no mapping).
- ``GOLD full``: TRL's GOLD (``trl.experimental.gold``) as its trainer runs it, TRL's own
  functions called on batches of ``--gold-batch`` completions: the student's per-token
  byte offsets from its sampled ids (``GOLDTrainer._maybe_add_completion_byte_offsets``,
  which counts ``piece_byte_len(piece) == len(piece)`` bytes per token), the teacher's ids
  and byte offsets from the text (``encode_with_byte_offsets``, as
  ``build_teacher_inputs_from_texts`` calls it), then ``ULDLoss._align_by_byte_offsets``
  per completion. GOLD maps no per-token trace here; its loss merges probabilities per
  group afterwards, so this row does less work than ``THL full``.
- ``GOLD groups``: only ``ULDLoss._align_by_byte_offsets`` on ready offsets.
- ``DP align+map``: the baseline, a Levenshtein alignment of the two token-string
  sequences (O(Ls * Lt) cells; match cost 0 for equal strings, 1 otherwise), then each
  target token takes the log-prob of the source token it was matched to (0 if none), as
  token-level cross-tokenizer aligners do.

Quality columns: mean and max ``|sum(mapped) - sum(source)|`` per sequence (nats). Each row
but DP is timed ``--repeat`` times and the fastest run is printed (the machine may be shared).

Chunk boundaries (second table). An interior cut after source token i and target token j is
*right* when the tokens before it on both sides spell the same prefix of the text's UTF-8
bytes (each token's bytes read by :func:`token_bytes`; both sides are first checked to spell
the whole text). Columns: the cuts THL makes (its chunk boundaries), the cuts GOLD makes (its
group boundaries), cuts both make, cuts only GOLD / only THL makes, ``agree`` = both /
(both + GOLD only + THL only), GOLD's wrong cuts (its groups then pair tokens that stand for
different bytes), THL's wrong or missing cuts (a THL cut that is not a shared boundary, or a
shared boundary THL lacks; 0 by construction), and the completions whose groups are
identical. Below it: the source tokens whose bytes GOLD counts wrong, by kind, with an
example, and how many disagreements come before the first of them in their completion.

Usage::

    pip install -e '.[bench]'   # trl, for GOLD
    OMP_NUM_THREADS=1 python benchmarks/thl_align.py [--n 1000] [--tokens 256] [--dp-n 1000] [--gold-batch 8] [--repeat 3]
"""

from __future__ import annotations

import os

# Before tokenizers is imported: its batch encoder (GOLD's teacher path) would use every core.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse
import math
import random
import re
import tempfile
import time
from itertools import accumulate
from types import SimpleNamespace

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


_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def load_gold() -> SimpleNamespace:
    """TRL's GOLD functions (``pip install -e '.[bench]'`` brings trl)."""
    from trl.experimental.gold.gold_trainer import GOLDTrainer, ULDLoss
    from trl.experimental.utils import encode_with_byte_offsets

    return SimpleNamespace(
        student=GOLDTrainer._maybe_add_completion_byte_offsets,
        teacher=encode_with_byte_offsets,
        groups=ULDLoss._align_by_byte_offsets,
    )


def gold_student_offsets(gold: SimpleNamespace, trainer: SimpleNamespace, batch: list[list[int]]) -> list[list[list[int]]]:
    """Per-token byte ``[start, end]`` of sampled completion ids, by GOLD's on-policy path.

    ``trainer`` stands in for the ``GOLDTrainer`` instance: the method reads only whether
    extended ULD is on and the student tokenizer. Rows are right-padded with label -100.
    """
    import torch

    width = max(map(len, batch))
    pad = trainer._tokenizer.pad_token_id or 0
    batch_slice = {
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch]),
        "labels": torch.tensor([ids + [-100] * (width - len(ids)) for ids in batch]),
    }
    gold.student(trainer, batch_slice)
    return [row[: len(ids)] for row, ids in zip(batch_slice["byte_offsets"].tolist(), batch)]


def cuts(src_sizes: list[int], tgt_sizes: list[int]) -> list[tuple[int, int]]:
    """Interior cuts (source tokens before, target tokens before) between consecutive groups."""
    out, i, j = [], 0, 0
    for a, b in zip(src_sizes[:-1], tgt_sizes[:-1]):
        i, j = i + a, j + b
        out.append((i, j))
    return out


def piece_kind(piece: str) -> str:
    if _BYTE_PIECE.match(piece):
        return "byte-fallback <0xHH> piece"
    if any(ord(c) > 127 for c in piece.replace("\u2581", "")):
        return "piece with a multi-byte character"
    return "other"


def best_of(repeat: int, fn):
    """(fastest wall time of ``repeat`` runs of ``fn``, the last run's result)."""
    best = math.inf
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def run_pair(label: str, src_tok, tgt_tok, texts: list[str], gold: SimpleNamespace, args) -> tuple[list, dict]:
    """Throughput rows and the chunk-boundary comparison for one (source, target) pair."""
    rng = random.Random(args.seed + 1)
    sources = [encode_completion(src_tok, t).completion_ids for t in texts]
    lps = [[-rng.uniform(0.001, 8.0) for _ in ids] for ids in sources]
    encode_completion(tgt_tok, "warm up")
    token_bytes(src_tok, sources[0])
    n, n_src = len(texts), sum(map(len, sources))
    rows = []

    def thl_full():
        errs, tgt_ids, alignments = [], [], []
        for text, ids, lp in zip(texts, sources, lps):
            tgt = encode_completion(tgt_tok, text).completion_ids
            al = align_bytes(token_bytes(src_tok, ids), token_bytes(tgt_tok, tgt))
            mapped = map_logprobs(lp, al)
            errs.append(abs(math.fsum(mapped) - math.fsum(lp)))
            tgt_ids.append(tgt)
            alignments.append(al)
        return errs, tgt_ids, alignments

    secs, (errs, tgt_ids, thl_al) = best_of(args.repeat, thl_full)
    rows.append((label, "THL full (retokenize+align+map)", n, n_src, secs, errs))

    src_pieces = [token_bytes(src_tok, ids) for ids in sources]
    tgt_pieces = [token_bytes(tgt_tok, ids) for ids in tgt_ids]
    secs, errs = best_of(args.repeat, lambda: [
        abs(math.fsum(map_logprobs(lp, align_bytes(a, b))) - math.fsum(lp)) for a, b, lp in zip(src_pieces, tgt_pieces, lps)
    ])
    rows.append((label, "THL align+map", n, n_src, secs, errs))
    secs, _ = best_of(args.repeat, lambda: [align_bytes(a, b) for a, b in zip(src_pieces, tgt_pieces)])
    rows.append((label, "THL align", n, n_src, secs, None))

    trainer = SimpleNamespace(
        use_uld_loss=True, teacher_tokenizer=tgt_tok, uld_loss_fn=SimpleNamespace(use_extended_uld=True), _tokenizer=src_tok
    )
    gold.teacher(tgt_tok.backend_tokenizer, ["warm up"])

    def gold_full():
        s_offs, t_offs, gold_tids, groups = [], [], [], []
        for b in range(0, n, args.gold_batch):
            s_batch = gold_student_offsets(gold, trainer, sources[b : b + args.gold_batch])
            t_batch = gold.teacher(tgt_tok.backend_tokenizer, texts[b : b + args.gold_batch], add_special_tokens=False)
            for so, (tids, to) in zip(s_batch, t_batch):
                groups.append(gold.groups(so, to))
                s_offs.append(so), t_offs.append(to), gold_tids.append(tids)
        return s_offs, t_offs, gold_tids, groups

    secs, (s_offs, t_offs, gold_tids, groups) = best_of(args.repeat, gold_full)
    rows.append((label, "GOLD full (offsets+teacher encode+groups)", n, n_src, secs, None))
    secs, _ = best_of(args.repeat, lambda: [gold.groups(so, to) for so, to in zip(s_offs, t_offs)])
    rows.append((label, "GOLD groups", n, n_src, secs, None))

    k = min(args.dp_n, n)
    src_str = [[p.decode("utf-8", "replace").strip() for p in ps] for ps in src_pieces[:k]]
    tgt_str = [[p.decode("utf-8", "replace").strip() for p in ps] for ps in tgt_pieces[:k]]
    secs, errs = best_of(1, lambda: [
        abs(math.fsum(dp_map(lp, len(b), dp_align(a, b))) - math.fsum(lp)) for a, b, lp in zip(src_str, tgt_str, lps[:k])
    ])
    rows.append((label, "DP edit-distance align+map", k, sum(map(len, sources[:k])), secs, errs))

    # Chunk boundaries against the text's bytes (untimed).
    st = dict(pair=label, thl=0, gold=0, both=0, gold_only=0, gold_wrong=0, thl_only=0, thl_wrong=0, thl_incomplete=0, identical=0,
              before_drift=0, spell=0, same_teacher_ids=0, src_tokens=n_src, wrong_src={}, wrong_tgt=0, examples={},
              drifted=0, metaspace=0, metaspace_wrong=0)
    for text, ids, sp, tp, al, (sg, tg), tids, thl_tids, so, to in zip(
        texts, sources, src_pieces, tgt_pieces, thl_al, groups, gold_tids, tgt_ids, s_offs, t_offs
    ):
        raw = text.encode()
        st["spell"] += b"".join(sp) == raw and b"".join(tp) == raw
        st["same_teacher_ids"] += tids == thl_tids
        s_cum = [0, *accumulate(map(len, sp))]
        t_cum = [0, *accumulate(map(len, tp))]
        g_cum = [0, *accumulate(map(len, token_bytes(tgt_tok, tids)))]
        thl_cuts = cuts(*al.chunk_sizes())
        shared = set(s_cum[1:-1]) & set(t_cum[1:-1])
        st["thl_wrong"] += sum(s_cum[i] != t_cum[j] for i, j in thl_cuts)
        thl_pos = {s_cum[i]: i for i, j in thl_cuts}
        st["thl_incomplete"] += len(shared ^ set(thl_pos))
        gold_cuts = cuts([len(g) for g in sg], [len(g) for g in tg])
        right = {s_cum[i]: i for i, j in gold_cuts if s_cum[i] == g_cum[j]}
        drift = next((q for q, ((s0, s1), p) in enumerate(zip(so, sp)) if s1 - s0 != len(p)), len(sp))
        pieces = src_tok.convert_ids_to_tokens(ids)
        st["drifted"] += drift < len(sp)
        for q, ((s0, s1), p) in enumerate(zip(so, sp)):
            st["metaspace"] += "\u2581" in pieces[q]
            if s1 - s0 != len(p):
                kind = piece_kind(pieces[q])
                st["metaspace_wrong"] += "\u2581" in pieces[q] and kind == "other"
                st["wrong_src"][kind] = st["wrong_src"].get(kind, 0) + 1
                st["examples"].setdefault(kind, (pieces[q], s1 - s0, len(p)))
        st["wrong_tgt"] += sum(e != c for (_, e), c in zip(to, g_cum[1:]))
        both = set(right) & set(thl_pos)
        wrong = [i for i, j in gold_cuts if s_cum[i] != g_cum[j]]
        missed = [thl_pos[p] for p in set(thl_pos) - set(right)]
        st["thl"] += len(thl_pos)
        st["gold"] += len(gold_cuts)
        st["both"] += len(both)
        st["gold_only"] += len(gold_cuts) - len(both)
        st["gold_wrong"] += len(wrong)
        st["thl_only"] += len(missed)
        st["before_drift"] += sum(i <= drift for i in wrong + missed)
        st["identical"] += tids == thl_tids and gold_cuts == thl_cuts
    return rows, st


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="number of completions")
    parser.add_argument("--tokens", type=int, default=256, help="approximate v1 tokens per completion")
    parser.add_argument("--dp-n", type=int, default=1000, help="completions run through the DP baseline (per pair)")
    parser.add_argument("--gold-batch", type=int, default=8, help="completions per GOLD batch")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row but DP; the fastest is printed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from mrl_lightning.recipes.tokenizers import train_byte_level_bpe

    t0 = time.perf_counter()
    try:
        gold = load_gold()
    except ImportError as exc:
        raise SystemExit(f"TRL's GOLD is needed for this benchmark ({exc}); install it with: pip install -e '.[bench]'")
    v1, tek = load_tokenizer("mistral-v1"), load_tokenizer("tekken")
    rng = random.Random(args.seed)
    texts = [make_text(rng, v1, args.tokens) for _ in range(args.n)]
    corpus_rng = random.Random(args.seed + 10_000)
    with tempfile.TemporaryDirectory() as folder:
        train_byte_level_bpe([make_text(corpus_rng, v1, args.tokens) for _ in range(200)], 1000, folder)
        bpe = load_tokenizer(folder)
    print(f"setup {time.perf_counter() - t0:.1f} s; {args.n} completions, {sum(map(len, texts))} characters; "
          f"byte-level BPE trained: {len(bpe)} ids")

    rows, stats = [], []
    for label, src in (("v1->tekken", v1), ("bpe->tekken", bpe)):
        r, st = run_pair(label, src, tek, texts, gold, args)
        rows += r
        stats.append(st)

    print(f"\n{'pair':12s} {'method':42s} {'seqs':>5s} {'src tokens':>10s} {'time s':>7s} {'tokens/s':>10s} "
          f"{'mean |dsum| nats':>16s} {'max |dsum|':>10s}")
    for label, name, n, toks, secs, e in rows:
        q = f"{sum(e) / len(e):16.3g} {max(e):10.3g}" if e else f"{'-':>16s} {'-':>10s}"
        print(f"{label:12s} {name:42s} {n:5d} {toks:10d} {secs:7.2f} {toks / secs:10,.0f} {q}")

    print("\nChunk boundaries (interior cuts), checked against the text's bytes:")
    print(f"{'pair':12s} {'THL':>7s} {'GOLD':>7s} {'both':>7s} {'GOLD only':>9s} {'THL only':>8s} {'agree':>6s} "
          f"{'GOLD wrong':>10s} {'THL wrong':>9s} {'identical':>10s}")
    for st in stats:
        denom = st["both"] + st["gold_only"] + st["thl_only"]
        print(f"{st['pair']:12s} {st['thl']:7d} {st['gold']:7d} {st['both']:7d} {st['gold_only']:9d} {st['thl_only']:8d} "
              f"{st['both'] / denom if denom else 1.0:6.1%} {st['gold_wrong']:10d} {st['thl_wrong'] + st['thl_incomplete']:9d} "
              f"{st['identical']:5d}/{args.n}")
    for st in stats:
        wrong = sum(st["wrong_src"].values())
        print(f"\n{st['pair']}: THL's tokens spell the text on both sides in {st['spell']}/{args.n}; GOLD's teacher "
              f"ids equal THL's target ids in {st['same_teacher_ids']}/{args.n}; teacher tokens with a wrong GOLD end "
              f"offset: {st['wrong_tgt']}")
        print(f"  source tokens whose bytes GOLD counts wrong: {wrong} of {st['src_tokens']} ({wrong / st['src_tokens']:.2%}), "
              f"in {st['drifted']}/{args.n} completions; pieces with \u2581: {st['metaspace']}, wrong because of the "
              f"\u2581: {st['metaspace_wrong']}; disagreements before the first miscounted token of their "
              f"completion: {st['before_drift']}")
        for kind, count in sorted(st["wrong_src"].items(), key=lambda kv: -kv[1]):
            piece, got, true = st["examples"][kind]
            print(f"    {kind}: {count} (e.g. {piece!r}: GOLD counts {got}, the text has {true} byte(s))")
    try:
        gold.teacher(v1.backend_tokenizer, ["x"])
    except NotImplementedError as exc:
        print(f"\nGOLD with Mistral v1 as teacher (or as off-policy student): NotImplementedError: {str(exc)[:80]}...")


if __name__ == "__main__":
    main()
