"""Time and peak memory of one policy's log-prob forward + backward: whole logits against chunks.

    python benchmarks/logprob_chunks.py --model /path/to/gemma-3-270m --rounds 2 --threads 2

For a model folder, ``--rows`` completions of ``--length`` tokens behind ``--prompts`` distinct
prompts (random token ids; prompts shared as in training), the policy's forward
(:func:`mrl_lightning.model.logprobs.completion_logprobs`, with entropy, as the first inner iteration)
and the backward of a loss over every counted token, in float32 or under bf16 autocast
(``--precision``), by

- ``plain``: the whole ``[N, L, V]`` logits (``allow_chunks=False``);
- ``chunked``: the output head in chunks of ``LOGPROB_CHUNK_ELEMENTS // V`` positions;

each in a fresh child process (so one variant's freed memory does not hide the other's peak),
alternating ``--rounds`` times. A child samples its RSS every 2 ms during the call and reports
the peak above its RSS before it (the model, its gradients from a warm-up call and the inputs
are already there): the memory the log-probs themselves take. Time it alone (docs/speed.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


def child(args) -> dict:
    import contextlib

    import psutil
    from transformers import AutoModelForCausalLM

    from mrl_lightning.model.logprobs import LOGPROB_CHUNK_ELEMENTS, completion_logprobs

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    g = args.rows // args.prompts
    prompt_ids = torch.randint(10, vocab, (args.prompts, 40), generator=gen).repeat_interleave(g, 0)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    completion_ids = torch.randint(10, vocab, (args.rows, args.length), generator=gen)
    completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16-mixed" \
        else contextlib.nullcontext

    def step():
        with autocast():
            logp, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                          temperature=1.0, with_entropy=True, allow_chunks=args.variant == "chunked")
        (logp * completion_mask).sum().div(completion_mask.sum()).backward()

    step()  # warm-up: gradients allocated, kernels chosen
    model.zero_grad(set_to_none=False)
    process, peak, done = psutil.Process(), [0], threading.Event()
    base = process.memory_info().rss

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    step()
    elapsed = time.perf_counter() - t0
    done.set()
    watcher.join()
    return {"seconds": elapsed, "peak_gib": (peak[0] - base) / 2**30, "vocab": vocab,
            "logits_gib": args.rows * args.length * vocab * 4 / 2**30,
            "chunk_positions": max(1, LOGPROB_CHUNK_ELEMENTS // vocab)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=16, help="N completions")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts (N / G)")
    parser.add_argument("--length", type=int, default=32, help="L completion tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--variant", choices=["plain", "chunked"], help=argparse.SUPPRESS)  # a child's
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args)))
        return 0
    results: dict[str, list[dict]] = {"plain": [], "chunked": []}
    for _ in range(args.rounds):
        for variant in results:
            cmd = [sys.executable, __file__, "--variant", variant] + [
                x for k, v in vars(args).items() if k not in ("variant", "rounds") for x in (f"--{k}", str(v))]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results[variant].append(json.loads(out))
    first = results["plain"][0]
    print(f"{args.model.name}: N={args.rows}, L={args.length}, V={first['vocab']} ([N, L, V] float32 = "
          f"{first['logits_gib']:.2f} GiB), chunks of {first['chunk_positions']} positions, {args.precision}, "
          f"{args.threads} thread(s), {args.rounds} alternating round(s); forward with entropy + backward:")
    for variant, runs in results.items():
        print(f"  {variant:8s} {statistics.median(r['seconds'] for r in runs):7.2f} s   peak above the model "
              f"{statistics.median(r['peak_gib'] for r in runs):6.2f} GiB   (rounds: "
              + ", ".join(f"{r['seconds']:.2f} s / {r['peak_gib']:.2f} GiB" for r in runs) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
