"""Speed against TRL: one GRPO policy, same model, data, reward and settings, in one process.

    pip install -e '.[bench]'           # adds trl
    python benchmarks/vs_trl.py --steps 30 --threads 2 --rounds 3

Builds one tiny GPT-2 (2 layers, width 128, byte-level BPE tokenizer trained on the task
text, as in the embedded default) into a temporary folder, then trains it for ``--steps``
steps with each trainer, one after the other, starting from the same weights, and does
that ``--rounds`` times (TRL, ours, TRL, ours, ...), so that a change of the machine's
speed during the invocation hits both trainers alike:

- TRL's ``GRPOTrainer`` (``use_cpu=True``),
- this project's loop (``MRLTrainer`` with one ``PolicyModule`` and the ``none`` probe),

both with 16 prompts x 8 completions per step (reasoning-gym 1-2 digit addition and
subtraction, rendered as ``"{question}\\nAnswer:"``), at most 8 new tokens, temperature 1,
``loss_type: dapo``, ``beta: 0``, AdamW at 3e-4, one iteration per batch, and the same
strict reward (reasoning-gym's verifier, 1 only for an exact answer). It prints the median
seconds per step of each over every round's steps after ``--warmup``, their ratio (ours /
TRL's; also per round), and where
each spends its time: sampling (``generate``), log-prob forwards, backward passes, and the
rest. Time it alone on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

PARTS = {
    "add": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False},
    "sub": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["-"],
            "allow_parentheses": False, "allow_negation": False},
}
TEMPLATE = "{question}\nAnswer:"


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


def data_module():
    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.data.reasoning_gym import TaskPart

    data = ReasoningGymDataModule([TaskPart(name, "basic_arithmetic", cfg) for name, cfg in PARTS.items()],
                                  batch_size=16, train_size=5000, eval_size=16, seed=0)
    data.setup()
    return data


def run_trl(folder: Path, data, steps: int, threads: int, out: Path) -> Timers:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mrl_lightning.rewards import ReasoningGymAccuracy

    torch.set_num_threads(threads)
    items = {x.prompt_id: x for p in PARTS for x in data.train_items(p)}
    rows = [{"prompt": TEMPLATE.format(question=x.question), "prompt_id": pid} for pid, x in items.items()]
    verifier = ReasoningGymAccuracy(strict=True)

    def reward(prompts, completions, prompt_id, **kwargs):
        return verifier(completions, [items[pid] for pid in prompt_id])

    config = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, per_device_train_batch_size=128,
                        num_generations=8, max_completion_length=8, temperature=1.0, top_p=1.0, top_k=0,
                        learning_rate=3e-4, beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1,
                        max_steps=steps, logging_steps=10**6, save_strategy="no", report_to=[], seed=0,
                        disable_dropout=True, bf16=False, dataloader_num_workers=0, max_grad_norm=1.0,
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0)
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


def run_ours(folder: Path, data, steps: int, threads: int, out: Path) -> Timers:
    from mrl_lightning.callbacks import NoSharing
    from mrl_lightning.callbacks.base import MRLCallback
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.rewards import ReasoningGymAccuracy
    from mrl_lightning.system import MutualRL
    from mrl_lightning.trainer import MRLTrainer

    timers = Timers()

    class StepTimer(MRLCallback):
        def on_fit_start(self, trainer, system):
            timers.begin()

        def on_train_step_end(self, trainer, system, metrics):
            timers.end()
            timers.begin()

    policy = PolicyModule(name="gpt2", model=str(folder), prompt_template=TEMPLATE, learning_rate=3e-4,
                          num_generations=8, max_completion_length=8, temperature=1.0, loss_type="dapo", beta=0.0,
                          strong_parts=["add"])
    system = MutualRL([policy], reward_funcs=[ReasoningGymAccuracy(strict=True)])
    trainer = MRLTrainer(max_steps=steps, accelerator="cpu", default_root_dir=str(out / "ours"),
                         callbacks=[NoSharing(), StepTimer()], log_every_n_steps=10**6,
                         eval_every_n_steps=10**6, checkpoint_every_n_steps=0, eval_num_generations=0,
                         num_sample_completions=0, enable_progress_bar=False, num_threads=threads, seed=0)
    original_eval = trainer._evaluate
    trainer._evaluate = lambda *a, **k: None  # no held-out evaluation inside the timed loop
    import mrl_lightning.policy as policy_module
    import mrl_lightning.system as system_module

    timers.wrap(system_module.MutualRL, "rollout", "sampling")
    timers.wrap(policy_module.PolicyModule, "completion_logprobs", "logprob_forward")
    timers.wrap(trainer.fabric, "backward", "backward")
    try:
        trainer.fit(system, data)
    finally:
        trainer._evaluate = original_eval
        timers.unwrap()
    return timers


def summarize(name: str, runs: list[Timers], warmup: int) -> dict[str, float]:
    """Medians over the timed steps of every round (each round's first ``warmup`` steps left out)."""
    rows = [row for timers in runs for row in timers.steps[warmup:]]
    out = {"step": statistics.median(r["step"] for r in rows)}
    for key in ("sampling", "logprob_forward", "backward"):
        out[key] = statistics.median(r.get(key, 0.0) for r in rows)
    out["rest"] = out["step"] - out["sampling"] - out["logprob_forward"] - out["backward"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both")
    parser.add_argument("--rounds", type=int, default=3,
                        help="TRL then ours, this many times; medians pool every round's timed steps")
    args = parser.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("trl is not installed: pip install -e '.[bench]'") from None
    runs: dict[str, list[Timers]] = {"trl": [], "ours": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        build_model(out / "model", data_module())
        with contextlib.redirect_stdout(sys.stderr):
            for round_ in range(args.rounds):  # TRL, ours, TRL, ours, ...: a drift of the machine's speed hits both
                runs["trl"].append(run_trl(out / "model", data_module(), args.steps, args.threads, out / f"r{round_}"))
                runs["ours"].append(run_ours(out / "model", data_module(), args.steps, args.threads, out / f"r{round_}"))
    results = {name: summarize(name, timers, args.warmup) for name, timers in runs.items()}
    per_round = [summarize("ours", [o], args.warmup)["step"] / summarize("trl", [t], args.warmup)["step"]
                 for t, o in zip(runs["trl"], runs["ours"])]
    print(f"median seconds per step over steps {args.warmup + 1}-{args.steps} of {args.rounds} alternating round(s), "
          f"{args.threads} thread(s), 16 prompts x 8 completions, 8 new tokens, dapo, beta 0:")
    print(f"{'':6s} {'step':>7s} {'sampling':>9s} {'logp fwd':>9s} {'backward':>9s} {'rest':>7s}")
    for name, r in results.items():
        print(f"{name:6s} {r['step']:7.3f} {r['sampling']:9.3f} {r['logprob_forward']:9.3f} {r['backward']:9.3f} "
              f"{r['rest']:7.3f}")
    print("ratio per round: " + ", ".join(f"{r:.2f}" for r in per_round))
    print(f"ratio ours / TRL: {results['ours']['step'] / results['trl']['step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
