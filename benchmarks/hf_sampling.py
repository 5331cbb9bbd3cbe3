"""Sampling speed of the HF rollout engine against a plain ``model.generate`` on the same prompts.

    python benchmarks/hf_sampling.py --model /path/to/smollm2 --model /path/to/gemma --rounds 5
    python benchmarks/hf_sampling.py --model ... --precision bf16-true

For each ``--model`` (a Hugging Face folder): ``--prompts`` reasoning-gym addition prompts
(through the tokenizer's chat template when it has one, else ``"{question}\\nAnswer:"``), each
sampled ``--generations`` times for at most ``--max-new-tokens`` tokens at temperature 1
(top-k and top-p off), stopping at the policy's stop ids, by

- ``plain``: ``model.generate(do_sample=True, num_return_sequences=G)``, the prompts repeated G
  times inside ``generate``, no logits returned;
- ``ours_<draw>``: :class:`~mrl_lightning.rollout.HFGenerateEngine` (shared prompt prefill,
  per-prompt seeded sampling with each ``--draw``, the sampled tokens' log-probs, finish reasons
  and texts),

alternating (plain, ours_race, ours_inverse_cdf, plain, ...) ``--rounds`` times after one warm-up
call of each, so a change of the machine's speed hits all alike. Tokens per second count every row of every decoding
step ``generate`` ran (rows x steps, what the forward passes computed); the share of those that
were counted (up to and including the stop token) is printed too. ``--precision``: ``32-true``,
``bf16-true`` (the model cast to bfloat16) or ``bf16-mixed`` (both calls under CPU autocast).
Prints per model and sampler the median tokens per second and its ratio to ``plain`` (the target
is >= 0.9; docs/speed.md).
Time it alone on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

TEMPLATE = "{question}\nAnswer:"


def prompts_for(tok, count: int) -> list[list[int]]:
    """``count`` addition prompts as token ids, in the tokenizer's chat format when it has one."""
    import reasoning_gym

    from mrl_lightning.model.chat import encode_rendered, render_chat_prompt

    data = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=count, min_terms=2, max_terms=2,
                                        min_digits=2, max_digits=3, operators=["+"])
    texts = [TEMPLATE.format(question=x["question"]) for x in data]
    if getattr(tok, "chat_template", None):
        return encode_rendered(tok, [render_chat_prompt(tok, t, None) for t in texts], 512)
    return tok(texts)["input_ids"]


def stop_ids(model, tok) -> list[int]:
    listed = model.generation_config.eos_token_id
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    return list(dict.fromkeys(i for i in [tok.eos_token_id, *listed] if i is not None))


def plain(model, tok, prompts, g: int, length: int, stops: list[int]) -> tuple[int, int]:
    """One plain ``generate``; returns (rows x steps, counted tokens)."""
    from mrl_lightning.rollout.base import left_pad
    from mrl_lightning.rollout.hf_generate import completion_mask_from_eos

    ids, mask = left_pad(prompts, tok.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, num_return_sequences=g,
                         max_new_tokens=length, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id,
                         eos_token_id=stops)
    completion = out[:, ids.shape[1]:]
    return completion.numel(), int(completion_mask_from_eos(completion, stops)[0].sum())


def ours(model, tok, prompts, g: int, length: int, stops: list[int], seed: int, draw: str) -> tuple[int, int]:
    from mrl_lightning.rollout import HFGenerateEngine

    out = HFGenerateEngine().generate(model, tok, prompts, num_generations=g, max_completion_length=length,
                                      temperature=1.0, stop_token_ids=stops, sampling_draw=draw,
                                      prompt_seeds=[seed * 1000 + i for i in range(len(prompts))])
    return out.completion_ids.numel(), int(out.completion_mask.sum())


def bench(folder: Path, args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16-mixed" \
        else contextlib.nullcontext
    prompts, stops = prompts_for(tok, args.prompts), stop_ids(model, tok)
    names = ["plain"] + [f"ours_{d}" for d in args.draw]
    rate: dict[str, list[float]] = {n: [] for n in names}
    counted: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(args.rounds + 1):  # round 0 warms every variant up and is left out
        for name in names:
            torch.manual_seed(round_)
            t0 = time.perf_counter()
            with torch.no_grad(), autocast():
                rows_steps, kept = plain(model, tok, prompts, args.generations, args.max_new_tokens, stops) \
                    if name == "plain" else ours(model, tok, prompts, args.generations, args.max_new_tokens, stops,
                                                 round_, name[len("ours_"):])
            elapsed = time.perf_counter() - t0
            if round_:
                rate[name].append(rows_steps / elapsed)
                counted[name].append(kept / rows_steps)
                print(f"{folder.name} round {round_} {name}: {elapsed:.2f} s, {rows_steps / elapsed:.1f} tokens/s",
                      file=sys.stderr)
    result = {"tokens_per_s": {n: statistics.median(v) for n, v in rate.items()},
              "counted_share": {n: statistics.mean(v) for n, v in counted.items()}}
    result["ratio"] = {n: statistics.median(v) / result["tokens_per_s"]["plain"] for n, v in rate.items() if n != "plain"}
    result["ratio_per_round"] = {n: [o / p for o, p in zip(v, rate["plain"])] for n, v in rate.items() if n != "plain"}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, action="append", required=True, help="a model folder (repeatable)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, each plain then ours")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true", "bf16-mixed"])
    parser.add_argument("--draw", nargs="+", default=["race", "inverse_cdf"], choices=["race", "inverse_cdf"],
                        help="our engine's sampling_draw(s), each a variant")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.prompts} prompts x {args.generations} completions x {args.max_new_tokens} tokens, temperature 1, "
          f"{args.threads} thread(s), {args.precision}, {args.rounds} alternating rounds, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}:")
    print(f"{'model':24s} {'sampler':18s} {'tokens/s':>9s} {'x plain':>8s}  per round  (counted share)")
    for folder in args.model:
        r = bench(folder, args)
        for name, rate in r["tokens_per_s"].items():
            ratio = r["ratio"].get(name)
            rounds = ", ".join(f"{x:.2f}" for x in r["ratio_per_round"].get(name, []))
            print(f"{folder.name:24s} {name:18s} {rate:9.1f} {'' if ratio is None else f'{ratio:8.2f}':>8s}  "
                  f"{rounds}  ({r['counted_share'][name]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
