"""Real completions of configs/real_small.yaml's two models, for the hand-labelled answer set (docs/answers.md).

    OMP_NUM_THREADS=1 python benchmarks/answer_labels.py --out runs/answer_labels.jsonl

Draws prompts of the config's two data parts (``chain`` and ``mul``: the same reasoning-gym generators and
settings, from ``--seed``) and builds its two policies (SmolLM2-135M-Instruct
with its chat template and no stop string; Gemma 3 270M base with ``"Question: {question}\\nAnswer:"`` and the
newline stop), exactly as ``configs/real_small.yaml`` sets them, and decodes held-out prompts of each part in
four passes (:data:`PASSES`): greedy with 32 new tokens, temperature-1 samples with 32 (the training rollouts'
length), 64 new tokens (greedy for SmolLM2, whose text then runs on; sampled for Gemma, which stops at its
newline) and temperature-1 samples with 64. Each row (model, part, pass, question, gold, prompt, completion, finish) is written as a JSON
line with ``label`` and ``note`` left empty: they are filled by reading the completion, never by running the
reader (rules: docs/answers.md, "The labelled set"), and the labelled file is
``tests/rewards/data/real_completions.jsonl``. With ``--relabel-from`` the labels of rows with the same
(model, part, pass, question, completion) are carried over from an earlier labelled file.

One torch thread (the machine is shared); about 6 minutes on a 2-core Xeon once the models are converted
(the first load converts each GGUF file into the model cache, about 1.5 minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
# name: (first prompt, prompts, new tokens, greedy?)
PASSES = {"greedy32": (0, 15, 32, True), "sample32": (15, 20, 32, False), "len64": (35, 5, 64, None),
          "sample64": (40, 10, 64, False)}


def config_parts_and_policies(path: Path) -> tuple[dict, list[dict]]:
    """The data's init args and each policy's init args, as the config file gives them."""
    cfg = yaml.safe_load(path.read_text())
    return cfg["data"]["init_args"], [p["init_args"] for p in cfg["model"]["policies"]]


def questions(part: dict, size: int, seed: int) -> list:
    """``size`` prompts of a config part, drawn by reasoning-gym from ``seed`` (the part's own generator)."""
    import reasoning_gym

    from mrl_lightning.data.items import PromptItem

    ds = reasoning_gym.create_dataset(part["dataset"], seed=seed, size=size, **part.get("config", {}))
    return [PromptItem(f"{part['name']}/l{i}", e["question"], str(e["answer"]), part["name"], e)
            for i, e in enumerate(ds)]


def decode(policy, items: list, new_tokens: int, greedy: bool, seed: int) -> tuple[list[str], list[str]]:
    """One completion per item, greedy or at the policy's temperature (one seed per prompt), with its stops."""
    from mrl_lightning.rollout import HFGenerateEngine

    out = HFGenerateEngine().generate(
        policy.model, policy.tokenizer, policy.encode_prompts([policy.render_prompt(x) for x in items]),
        num_generations=1, max_completion_length=new_tokens, do_sample=not greedy, temperature=policy.temperature,
        prompt_seeds=[seed + i for i in range(len(items))], stop_token_ids=policy.stop_token_ids,
        sampling_draw=policy.sampling_draw, **policy.stop_kwargs)
    return out.completion_texts, out.finish_reasons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "real_small.yaml"))
    parser.add_argument("--out", default="runs/answer_labels.jsonl")
    parser.add_argument("--relabel-from", default=None, help="a labelled file whose labels are carried over")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from mrl_lightning.builders import build_policy
    from mrl_lightning.policy import PolicyModule

    data_args, policy_args = config_parts_and_policies(Path(args.config))
    parts = {p["name"]: questions(p, sum(count for _, count, _, _ in PASSES.values()), args.seed)
             for p in data_args["parts"]}
    old = {}
    if args.relabel_from:
        for line in Path(args.relabel_from).read_text().splitlines():
            r = json.loads(line)
            old[(r["model"], r["part"], r["pass"], r["question"], r["completion"])] = (r["label"], r.get("note", ""))
    rows = []
    for init in policy_args:
        policy = PolicyModule(**init)  # num_generations is not used: one completion per prompt here
        build_policy(policy)
        policy.model.eval()
        for part, items in parts.items():
            for name, (first, count, new_tokens, greedy) in PASSES.items():
                greedy = policy.stop_kwargs.get("stop") is None if greedy is None else greedy
                chunk = items[first:first + count]
                with torch.no_grad():
                    texts, finish = decode(policy, chunk, new_tokens, greedy, args.seed + first)
                for item, text, why in zip(chunk, texts, finish):
                    key = (policy.policy_name, part, name, item.question, text)
                    label, note = old.get(key, (None, "UNLABELLED"))
                    rows.append({"model": policy.policy_name, "part": part, "pass": name,
                                 "greedy": greedy, "new_tokens": new_tokens, "question": item.question,
                                 "prompt": policy.render_prompt(item), "gold": item.answer,
                                 "completion": text, "finish": why, "label": label, "note": note})
                print(f"{policy.policy_name} {part} {name}: {len(chunk)} rows", flush=True)
        del policy
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
