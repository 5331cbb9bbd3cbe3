"""Speed against TRL: one GRPO policy, same model, data, reward and settings, in one process.

    pip install -e '.[bench]'           # adds trl
    python benchmarks/vs_trl.py --steps 30 --threads 2 --rounds 3
    python benchmarks/vs_trl.py --model /path/to/SmolLM2-135M-Instruct --steps 4 --warmup 1 --rounds 3
    python benchmarks/vs_trl.py --model ... --precision bf16-mixed

Without ``--model`` it builds one tiny GPT-2 (2 layers, width 128, byte-level BPE tokenizer
trained on the task text, as in the embedded default) into a temporary folder; with
``--model`` (a Hugging Face folder, e.g. a converted SmolLM2-135M-Instruct) both trainers load
that folder, and prompts go through its chat template when it has one (TRL: conversational
rows; ours: ``chat_template: true``), so both see the same prompt tokens. Each trainer runs
``--steps`` steps from the same weights, one after the other, ``--rounds`` times (TRL, ours,
TRL, ours, ...), so that a change of the machine's speed during the invocation hits both alike:

- TRL's ``GRPOTrainer`` (``use_cpu=True``),
- this project's loop (``MRLTrainer`` with one ``PolicyModule`` and the ``none`` probe),

both with ``--prompts`` prompts x ``--generations`` completions per step (reasoning-gym 1-2 digit
addition and subtraction, rendered as ``"{question}\\nAnswer:"``), at most ``--max-new-tokens``
new tokens, temperature 1, ``loss_type: dapo``, ``beta: 0``, AdamW at ``--lr``, one iteration per
batch, fused AdamW (TRL's default ``adamw_torch_fused``; ours ``fused_optimizer: true``), the
same strict reward (reasoning-gym's verifier) and the same precision (``--precision``:
``32-true``; ``bf16-mixed`` is TRL's ``bf16=True``, CPU autocast in both). It prints the median
seconds per step of each over every round's steps after ``--warmup``, their ratio (ours / TRL's;
also per round), and where each spends its time: sampling (``generate``), log-prob forwards,
backward passes, and the rest. Time it alone on the machine (docs/speed.md).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

PARTS = {
    "add": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False},
    "sub": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["-"],
            "allow_parentheses": False, "allow_negation": False},
}
TEMPLATE = "{question}\nAnswer:"


@dataclass
class Settings:
    """What both trainers run with (one place, so the two cannot drift apart)."""

    prompts: int = 16
    generations: int = 8
    max_new_tokens: int = 8
    lr: float = 3e-4
    precision: str = "32-true"
    threads: int = 2
    chat: bool = False  # prompts through the tokenizer's chat template
    draw: str = "race"  # our hf engine's sampling_draw (one distribution; TRL samples with torch.multinomial)


class Timers:
    """Seconds spent inside wrapped methods, per step."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._start = 0.0
        self._wrapped: list[tuple[object, str, object, bool]] = []

    def wrap(self, obj, attr: str, label: str) -> None:
        original = getattr(obj, attr)
        own = attr in getattr(obj, "__dict__", {})  # defined on obj itself, or inherited / a class method
        self._wrapped.append((obj, attr, obj.__dict__[attr] if own else None, own))

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def unwrap(self) -> None:
        """Put the wrapped methods back (the next round wraps the originals, not these wrappers)."""
        for obj, attr, original, own in reversed(self._wrapped):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
        self._wrapped.clear()

    def begin(self) -> None:
        self.total.clear()
        self._start = time.perf_counter()

    def end(self) -> None:
        row = dict(self.total)
        row["step"] = time.perf_counter() - self._start
        self.steps.append(row)


def build_model(folder: Path, data) -> None:
    """The shared starting point: tokenizer trained on the task text, 2-layer GPT-2, saved."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_tokenizer

    corpus = [TEMPLATE.format(question=x.question) + f" {x.answer}" for p in PARTS for x in data.train_items(p)[:2000]]
    tok = train_tokenizer("byte_level_bpe", corpus, 320, folder)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))


def data_module(prompts: int):
    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.data.reasoning_gym import TaskPart

    data = ReasoningGymDataModule([TaskPart(name, "basic_arithmetic", cfg) for name, cfg in PARTS.items()],
                                  batch_size=prompts, train_size=5000, eval_size=16, seed=0)
    data.setup()
    return data


def run_trl(folder: Path, data, steps: int, s: Settings, out: Path) -> Timers:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mrl_lightning.rewards import ReasoningGymAccuracy

    torch.set_num_threads(s.threads)
    items = {x.prompt_id: x for p in PARTS for x in data.train_items(p)}

    def prompt(x):
        text = TEMPLATE.format(question=x.question)
        return [{"role": "user", "content": text}] if s.chat else text

    rows = [{"prompt": prompt(x), "prompt_id": pid} for pid, x in items.items()]
    verifier = ReasoningGymAccuracy(strict=True)

    def reward(prompts, completions, prompt_id, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return verifier(texts, [items[pid] for pid in prompt_id])

    config = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, per_device_train_batch_size=s.prompts * s.generations,
                        num_generations=s.generations, max_completion_length=s.max_new_tokens, temperature=1.0,
                        top_p=1.0, top_k=0, learning_rate=s.lr, beta=0.0, loss_type="dapo", scale_rewards="group",
                        num_iterations=1, max_steps=steps, logging_steps=10**6, save_strategy="no", report_to=[],
                        seed=0, disable_dropout=True, bf16=s.precision.startswith("bf16"), dataloader_num_workers=0,
                        max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)
    timers = Timers()
    timers.wrap(trainer, "_generate", "sampling")
    timers.wrap(trainer, "_get_per_token_logps_and_entropies", "logprob_forward")
    timers.wrap(trainer.accelerator, "backward", "backward")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            timers.begin()

        def on_step_end(self, *args, **kwargs):
            timers.end()

    trainer.add_callback(StepTimer())
    try:
        trainer.train()
    finally:
        timers.unwrap()
    return timers


def run_ours(folder: Path, data, steps: int, s: Settings, out: Path, profile: Path | None = None) -> Timers:
    from mrl_lightning.callbacks import NoSharing
    from mrl_lightning.callbacks.base import MRLCallback
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.rewards import ReasoningGymAccuracy
    from mrl_lightning.loop.system import MutualRL
    from mrl_lightning.loop.trainer import MRLTrainer

    timers = Timers()
    profiler = None

    class StepTimer(MRLCallback):
        def on_fit_start(self, trainer, system):
            timers.begin()

        def on_train_step_end(self, trainer, system, metrics):
            nonlocal profiler
            timers.end()
            if profiler is not None:
                profiler.__exit__(None, None, None)
                profiler.export_chrome_trace(str(profile))
                print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
                profiler = None
            if profile is not None and len(timers.steps) == steps - 1:  # profile the last step
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                profiler.__enter__()
            timers.begin()

    policy = PolicyModule(name="policy", model=str(folder), prompt_template=TEMPLATE, learning_rate=s.lr,
                          num_generations=s.generations, max_completion_length=s.max_new_tokens, temperature=1.0,
                          loss_type="dapo", beta=0.0, strong_parts=["add"], chat_template=s.chat,
                          max_prompt_length=256, fused_optimizer=True,  # TRL's default optimizer: adamw_torch_fused
                          sampling_draw=s.draw)
    system = MutualRL([policy], reward_funcs=[ReasoningGymAccuracy(strict=True)])
    trainer = MRLTrainer(max_steps=steps, accelerator="cpu", default_root_dir=str(out / "ours"),
                         callbacks=[NoSharing(), StepTimer()], log_every_n_steps=10**6, precision=s.precision,
                         eval_every_n_steps=10**6, checkpoint_every_n_steps=0, eval_num_generations=0,
                         num_sample_completions=0, enable_progress_bar=False, num_threads=s.threads, seed=0)
    original_eval = trainer._evaluate
    trainer._evaluate = lambda *a, **k: None  # no held-out evaluation inside the timed loop
    import mrl_lightning.policy as policy_module
    import mrl_lightning.loop.system as system_module

    timers.wrap(system_module.MutualRL, "rollout", "sampling")
    timers.wrap(policy_module.PolicyModule, "completion_logprobs", "logprob_forward")
    timers.wrap(trainer.fabric, "backward", "backward")
    try:
        trainer.fit(system, data)
    finally:
        trainer._evaluate = original_eval
        timers.unwrap()
    return timers


def summarize(runs: list[Timers], warmup: int) -> dict[str, float]:
    """Medians over the timed steps of every round (each round's first ``warmup`` steps left out)."""
    rows = [row for timers in runs for row in timers.steps[warmup:]]
    out = {"step": statistics.median(r["step"] for r in rows)}
    for key in ("sampling", "logprob_forward", "backward"):
        out[key] = statistics.median(r.get(key, 0.0) for r in rows)
    out["rest"] = out["step"] - out["sampling"] - out["logprob_forward"] - out["backward"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face model folder both trainers load; default: a tiny GPT-2 built here")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both")
    parser.add_argument("--rounds", type=int, default=3,
                        help="TRL then ours, this many times; medians pool every round's timed steps")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (16; 4 with --model)")
    parser.add_argument("--generations", type=int, default=None, help="completions per prompt (8; 4 with --model)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="(8; 32 with --model)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (3e-4; 1e-6 with --model)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--draw", choices=["race", "inverse_cdf"], default=None,
                        help="our sampling_draw (race; inverse_cdf with --model, as configs for real models)")
    parser.add_argument("--only", choices=["trl", "ours"], default=None, help="run one trainer only")
    parser.add_argument("--profile", type=Path, default=None,
                        help="torch.profiler trace of ours' last step of the first round (chrome trace JSON)")
    args = parser.parse_args(argv)
    real = args.model is not None
    s = Settings(prompts=args.prompts or (4 if real else 16), generations=args.generations or (4 if real else 8),
                 max_new_tokens=args.max_new_tokens or (32 if real else 8), lr=args.lr or (1e-6 if real else 3e-4),
                 precision=args.precision, threads=args.threads,
                 draw=args.draw or ("inverse_cdf" if real else "race"))
    if args.only != "ours":
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("trl is not installed: pip install -e '.[bench]'") from None
    names = [n for n in ("trl", "ours") if args.only in (None, n)]
    runs: dict[str, list[Timers]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        folder = args.model
        if folder is None:
            folder = out / "model"
            build_model(folder, data_module(s.prompts))
        else:
            from transformers import AutoTokenizer

            s.chat = bool(getattr(AutoTokenizer.from_pretrained(str(folder)), "chat_template", None))
        with contextlib.redirect_stdout(sys.stderr):
            for round_ in range(args.rounds):  # TRL, ours, TRL, ours, ...: a drift of the machine's speed hits both
                if "trl" in runs:
                    runs["trl"].append(run_trl(folder, data_module(s.prompts), args.steps, s, out / f"r{round_}"))
                if "ours" in runs:
                    runs["ours"].append(run_ours(folder, data_module(s.prompts), args.steps, s, out / f"r{round_}",
                                                 args.profile if round_ == 0 else None))
    results = {name: summarize(timers, args.warmup) for name, timers in runs.items()}
    print(f"median seconds per step over steps {args.warmup + 1}-{args.steps} of {args.rounds} alternating round(s), "
          f"{s.threads} thread(s), {s.prompts} prompts x {s.generations} completions, {s.max_new_tokens} new tokens, "
          f"dapo, beta 0, {s.precision}, our sampling_draw {s.draw}, model {args.model or 'tiny GPT-2'}:")
    print(f"{'':6s} {'step':>7s} {'sampling':>9s} {'logp fwd':>9s} {'backward':>9s} {'rest':>7s}")
    for name, r in results.items():
        print(f"{name:6s} {r['step']:7.3f} {r['sampling']:9.3f} {r['logprob_forward']:9.3f} {r['backward']:9.3f} "
              f"{r['rest']:7.3f}")
    if len(runs) == 2:
        per_round = [summarize([o], args.warmup)["step"] / summarize([t], args.warmup)["step"]
                     for t, o in zip(runs["trl"], runs["ours"])]
        print("ratio per round: " + ", ".join(f"{r:.2f}" for r in per_round))
        print(f"ratio ours / TRL: {results['ours']['step'] / results['trl']['step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
